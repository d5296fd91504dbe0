//! Who a command runs as: `/etc/passwd` and `/etc/group` read directly.
//!
//! The agent is a static binary, so it must not use glibc's NSS (`getpwnam`): that would try
//! to load shared modules. Machines only know local users anyway.

use std::fs;

/// A resolved user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    /// Supplementary groups (including the primary one).
    pub groups: Vec<u32>,
}

/// Resolves a user name or numeric uid (`None`: root) against the given files' contents.
pub fn resolve_in(spec: Option<&str>, passwd: &str, group: &str) -> Result<User, String> {
    let spec = spec.unwrap_or("root").trim();
    let by_uid: Option<u32> = spec.parse().ok();
    let entry = passwd.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 7 {
            return None;
        }
        let uid: u32 = f[2].parse().ok()?;
        let gid: u32 = f[3].parse().ok()?;
        let hit = match by_uid {
            Some(u) => u == uid,
            None => f[0] == spec,
        };
        hit.then(|| (f[0].to_string(), uid, gid, f[5].to_string()))
    });
    let (name, uid, gid, home) = match (entry, by_uid) {
        (Some(e), _) => e,
        // A bare uid the machine does not know still works, as in `docker run --user 1234`.
        (None, Some(u)) => (u.to_string(), u, u, "/".to_string()),
        (None, None) if spec == "root" => ("root".into(), 0, 0, "/root".into()),
        (None, None) => return Err(format!("no user {spec:?} in the machine's /etc/passwd")),
    };
    let mut groups = vec![gid];
    for l in group.lines() {
        let f: Vec<&str> = l.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(g) = f[2].parse::<u32>() else { continue };
        if f[3].split(',').any(|m| m == name) && !groups.contains(&g) {
            groups.push(g);
        }
    }
    Ok(User {
        name,
        uid,
        gid,
        home: if home.is_empty() { "/".into() } else { home },
        groups,
    })
}

/// Resolves a user against the machine's `/etc/passwd` and `/etc/group`.
pub fn resolve(spec: Option<&str>) -> Result<User, String> {
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    let group = fs::read_to_string("/etc/group").unwrap_or_default();
    resolve_in(spec, &passwd, &group)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PASSWD: &str =
        "root:x:0:0:root:/root:/bin/bash\nbob:x:1000:1000::/home/bob:/bin/sh\nbad line\n";
    const GROUP: &str = "root:x:0:\nbob:x:1000:\ndocker:x:999:alice,bob\nwheel:x:10:alice\n";

    #[test]
    fn names_and_uids_resolve_with_groups() {
        let b = resolve_in(Some("bob"), PASSWD, GROUP).unwrap();
        assert_eq!(
            (b.uid, b.gid, b.home.as_str(), b.groups.clone()),
            (1000, 1000, "/home/bob", vec![1000, 999])
        );
        assert_eq!(resolve_in(Some("1000"), PASSWD, GROUP).unwrap().name, "bob");
        assert_eq!(resolve_in(None, PASSWD, GROUP).unwrap().uid, 0);
        let anon = resolve_in(Some("4242"), PASSWD, GROUP).unwrap();
        assert_eq!((anon.uid, anon.gid, anon.home.as_str()), (4242, 4242, "/"));
        assert!(resolve_in(Some("mallory"), PASSWD, GROUP).is_err());
    }
}
