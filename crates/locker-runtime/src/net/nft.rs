//! Running the host's network programs (`nft`, `ip`, `nsenter`) and installing rulesets.
//!
//! Owns finding the programs ([`tool`]), running one with its input on stdin ([`run`]) and
//! the two ways a ruleset is installed: in the host's namespace ([`install_on_host`]) and in
//! a machine's ([`install_in_netns`]). It does not decide what a ruleset says
//! ([`super::rules`] does) or when it is installed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::{NetError, TABLE};

/// Runs `cmd` with `input` on its stdin (or none), as the step `step`; fails with its
/// stderr when it does not exit 0.
pub(super) fn run(step: &str, cmd: &mut Command, input: Option<&str>) -> Result<(), NetError> {
    let command = format!("{cmd:?}");
    cmd.stdin(if input.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| NetError::Spawn {
        step: step.to_owned(),
        command: command.clone(),
        source,
    })?;
    if let Some(s) = input {
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin
            .write_all(s.as_bytes())
            .map_err(NetError::io(format!("{step}: write to {command}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(NetError::io(format!("{step}: wait for {command}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetError::Command {
            step: step.to_owned(),
            command,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

/// Finds a program egress needs on `PATH`, or says which package brings it.
pub(super) fn tool(name: &'static str) -> Result<PathBuf, NetError> {
    crate::doctor::which(name).ok_or(NetError::ToolMissing {
        tool: name,
        package: match name {
            "nft" => "nftables",
            "ip" => "iproute2",
            _ => "util-linux",
        },
    })
}

/// Installs `ruleset` in the host's namespace, as the step `step`.
pub(super) fn install_on_host(step: &str, ruleset: &str) -> Result<(), NetError> {
    run(
        step,
        Command::new(tool("nft")?).arg("-f").arg("-"),
        Some(ruleset),
    )
}

/// Installs `ruleset` in the network namespace `ns` (a path: `/proc/<pid>/ns/net` of a
/// jail's PID 1, `/run/netns/<name>` of a microVM). `nft` runs in the host's mount
/// namespace, so the machine's filesystem has no say in which program runs.
pub(super) fn install_in_netns(ns: &Path, ruleset: &str) -> Result<(), NetError> {
    run(
        &format!(
            "installing the rules in the network namespace {}",
            ns.display()
        ),
        Command::new(tool("nsenter")?)
            .arg(format!("--net={}", ns.display()))
            .arg(tool("nft")?)
            .arg("-f")
            .arg("-"),
        Some(ruleset),
    )
}

/// Deletes a machine's host table; whether it is gone.
pub(super) fn delete_machine_table(table: &str) -> bool {
    match crate::doctor::which("nft") {
        Some(nft) => run(
            "deleting a machine's host table",
            Command::new(nft).args(["delete", "table", "ip", table]),
            None,
        )
        .is_ok(),
        None => false,
    }
}

/// The machines' own host tables (`ip locker_lk<slot>`) that exist now.
pub(super) fn machine_tables() -> Vec<String> {
    let Some(nft) = crate::doctor::which("nft") else {
        return Vec::new();
    };
    let Ok(out) = Command::new(nft)
        .args(["list", "tables", "ip"])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
    else {
        return Vec::new();
    };
    machine_tables_in(&String::from_utf8_lossy(&out.stdout))
}

/// The machine tables named in `nft list tables ip`'s output.
fn machine_tables_in(listing: &str) -> Vec<String> {
    let prefix = format!("{TABLE}_lk");
    listing
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table ip "))
        .filter(|t| {
            t.strip_prefix(&prefix)
                .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_machine_tables_are_listed() {
        let listing = "table ip locker_lk5\ntable ip nat\ntable ip locker_lk\n\
                       table ip locker_lkx1\ntable ip locker_lk123456\ntable inet locker\n";
        assert_eq!(
            machine_tables_in(listing),
            ["locker_lk5", "locker_lk123456"]
        );
    }

    #[test]
    fn a_missing_program_names_its_package() {
        let e = NetError::ToolMissing {
            tool: "nft",
            package: "nftables",
        };
        assert_eq!(
            e.to_string(),
            "`nft` not found: install nftables (apt-get install nftables; scripts/setup does)"
        );
    }

    #[test]
    fn a_failing_program_names_the_step_and_its_stderr() {
        let e = run(
            "installing a test rule",
            Command::new("sh").args(["-c", "echo no such table >&2; exit 1"]),
            None,
        )
        .unwrap_err();
        let shown = e.to_string();
        assert!(shown.starts_with("installing a test rule: "), "{shown}");
        assert!(shown.ends_with(" failed: no such table"), "{shown}");
        let e = run(
            "running nothing",
            &mut Command::new("/nonexistent/locker-net-test"),
            Some("x"),
        )
        .unwrap_err();
        assert!(matches!(e, NetError::Spawn { .. }), "{e:?}");
        assert!(
            e.to_string().starts_with("running nothing: cannot run "),
            "{e}"
        );
        run(
            "feeding cat",
            &mut Command::new("cat"),
            Some("table ip x {}\n"),
        )
        .unwrap();
    }
}
