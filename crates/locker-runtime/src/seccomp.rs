//! The system-call filter every jailed process runs under.
//!
//! A deny list in the spirit of the usual container profiles: what a machine's root has no
//! business doing (load kernel modules, kexec, reboot, bpf, perf, keyrings, userfaultfd,
//! mounting, new namespaces, io_uring, handles to host files, tracing or reaching into
//! another process: the agent, PID 1, belongs to the host) fails with EPERM; `clone3`
//! answers ENOSYS so libc falls back to `clone`, whose flags the filter can inspect.
//! `socket` and `socketpair` open only the families a machine needs (unix, inet, inet6,
//! netlink); any other family answers EAFNOSUPPORT. A first, hand-written filter refuses
//! every call that is not a native x86-64 one (x32 numbers, `nr | 0x40000000`, reach the
//! same kernel entry points under other numbers, and a deny list keyed by number would let
//! them through). Installed last in the jail's init, after `no_new_privs`, and inherited by
//! everything. This room owns the policy only; the jail decides when it is installed.

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
    // The agent (PID 1) is the host's: no command may stop it, read or write its memory or
    // take its descriptors (the agent is also non-dumpable, which closes `/proc/1/*`).
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
];

/// The socket families a machine may open: local sockets, IPv4, IPv6 and netlink (`ip`,
/// `ss` and glibc's interface enumeration speak it; the network namespace is the
/// machine's own). Everything else is refused: vsock above all, whose port space is the
/// host's (not namespaced), and packet, key, alg, bluetooth, ... sockets, which a tool call
/// has no use for and which widen the kernel surface.
const SOCKET_FAMILIES: &[u64] = &[
    libc::AF_UNIX as u64,
    libc::AF_INET as u64,
    libc::AF_INET6 as u64,
    libc::AF_NETLINK as u64,
];

/// `AUDIT_ARCH_X86_64`: `EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE`.
const AUDIT_ARCH_X86_64: u32 = 62 | 0x8000_0000 | 0x4000_0000;
/// The x32 ABI's bit in a system call number.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

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

fn build_err(e: impl std::fmt::Display) -> SeccompError {
    SeccompError::Build(e.to_string())
}

/// The first filter, as libseccomp writes it: a call that carries the x32 bit fails with
/// EPERM whatever its number. A call of another audit arch (the i386 `int 0x80` entry)
/// gets EPERM here too; seccompiler's own filters kill the process for it, and the
/// strictest answer wins.
fn native_only() -> BpfProgram {
    use seccompiler::sock_filter;
    const LD_W_ABS: u16 = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    const JEQ_K: u16 = (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16;
    const JGE_K: u16 = (libc::BPF_JMP | libc::BPF_JGE | libc::BPF_K) as u16;
    const RET_K: u16 = (libc::BPF_RET | libc::BPF_K) as u16;
    // `struct seccomp_data`: nr at offset 0, arch at offset 4.
    let op = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    let eperm = libc::SECCOMP_RET_ERRNO | libc::EPERM as u32;
    vec![
        op(LD_W_ABS, 0, 0, 4),
        op(JEQ_K, 1, 0, AUDIT_ARCH_X86_64),
        op(RET_K, 0, 0, eperm),
        op(LD_W_ABS, 0, 0, 0),
        op(JGE_K, 0, 1, X32_SYSCALL_BIT),
        op(RET_K, 0, 0, eperm),
        op(RET_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ]
}

/// `socket` and `socketpair` with a family outside [`SOCKET_FAMILIES`]: one rule whose
/// conditions (ANDed) say "the family is none of them".
fn foreign_families() -> Result<BTreeMap<i64, Vec<SeccompRule>>, SeccompError> {
    let mut conds = Vec::new();
    for fam in SOCKET_FAMILIES {
        // The family is an `int`: the kernel reads the low 32 bits only, so must we.
        conds.push(
            SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, *fam)
                .map_err(build_err)?,
        );
    }
    let rule = SeccompRule::new(conds).map_err(build_err)?;
    Ok([
        (libc::SYS_socket, vec![rule.clone()]),
        (libc::SYS_socketpair, vec![rule]),
    ]
    .into_iter()
    .collect())
}

fn build(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    action: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let f = SeccompFilter::new(rules, SeccompAction::Allow, action, TargetArch::x86_64)
        .map_err(|e| SeccompError::Build(e.to_string()))?;
    f.try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))
}

/// The filters (native x86-64 only, EPERM deny list, EAFNOSUPPORT for foreign socket
/// families, ENOSYS for clone3), compiled. The kernel runs them all on every call and the
/// strictest answer wins; they never match the same call, so each answer is its own.
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
    // EAFNOSUPPORT is what a kernel built without the family answers: software probing for
    // vsock or AF_ALG falls back as it would there, where EPERM would read as a failure.
    Ok(vec![
        native_only(),
        build(enosys, SeccompAction::Errno(libc::ENOSYS as u32))?,
        build(deny, SeccompAction::Errno(libc::EPERM as u32))?,
        build(
            foreign_families()?,
            SeccompAction::Errno(libc::EAFNOSUPPORT as u32),
        )?,
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
        assert_eq!(p.len(), 4);
        assert!(p[2].len() > super::DENIED.len());
    }
}
