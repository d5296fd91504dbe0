//! The system-call filter every jailed process runs under.
//!
//! A deny list in the spirit of the usual container profiles: what a machine's root has no
//! business doing (load kernel modules, kexec, reboot, bpf, perf, keyrings, userfaultfd,
//! mounting, new namespaces, io_uring, handles to host files) fails with EPERM; `clone3`
//! answers ENOSYS so libc falls back to `clone`, whose flags the filter can inspect.
//! Installed last in the jail's init, after `no_new_privs`, and inherited by everything.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Errors building or installing the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the seccomp filter: {0}")]
    Build(String),
    #[error("installing the seccomp filter: {0}")]
    Install(String),
}

/// Syscalls denied outright.
const DENIED: &[i64] = &[
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_reboot,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_userfaultfd,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_open_tree,
    libc::SYS_move_mount,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_settimeofday,
    libc::SYS_clock_settime,
    libc::SYS_clock_adjtime,
    libc::SYS_adjtimex,
    libc::SYS_syslog,
    libc::SYS_iopl,
    libc::SYS_ioperm,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    libc::SYS_lookup_dcookie,
    libc::SYS_quotactl,
    libc::SYS_setns,
    libc::SYS_unshare,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_uselib,
    libc::SYS_vhangup,
    libc::SYS_kcmp,
    libc::SYS_fanotify_init,
    libc::SYS_nfsservctl,
];

const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
    0x80, // CLONE_NEWTIME
];

fn build(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let f = SeccompFilter::new(rules, SeccompAction::Allow, action, TargetArch::x86_64)
        .map_err(|e| SeccompError::Build(e.to_string()))?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))
}

/// The two filters (EPERM deny list, ENOSYS for clone3), compiled.
pub fn programs() -> Result<Vec<BpfProgram>, SeccompError> {
    let mut deny: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|s| (*s, vec![])).collect();
    let mut clone_rules = Vec::new();
    for flag in NAMESPACE_FLAGS {
        let c = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(*flag),
            *flag,
        )
        .map_err(|e| SeccompError::Build(e.to_string()))?;
        clone_rules
            .push(SeccompRule::new(vec![c]).map_err(|e| SeccompError::Build(e.to_string()))?);
    }
    deny.insert(libc::SYS_clone, clone_rules);
    let enosys: BTreeMap<i64, Vec<SeccompRule>> =
        [(libc::SYS_clone3, vec![])].into_iter().collect();
    Ok(vec![
        build(enosys, SeccompAction::Errno(libc::ENOSYS as u32))?,
        build(deny, SeccompAction::Errno(libc::EPERM as u32))?,
    ])
}

/// Installs the filters on the calling thread (inherited across fork and exec).
/// `no_new_privs` must already be set.
pub fn install(progs: &[BpfProgram]) -> Result<(), SeccompError> {
    for p in progs {
        seccompiler::apply_filter(p).map_err(|e| SeccompError::Install(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn filters_compile() {
        let p = super::programs().unwrap();
        assert_eq!(p.len(), 2);
        assert!(p[1].len() > super::DENIED.len());
    }
}
