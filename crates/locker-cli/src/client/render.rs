//! What people see: one-line errors, aligned tables, `key: value` listings, relative
//! times. Pure functions over strings and JSON, so every format is unit-tested.
//!
//! Everything printed here came from the server, and a sandbox's contents are written by
//! whatever ran in it: control characters are replaced before they reach the terminal, so
//! a file name cannot move the cursor or retitle the window.

use serde_json::Value;

use super::ClientError;

/// The line printed for `e` (`locker: …`), or `None` when nothing should be printed (a
/// closed stdout pipe).
pub fn error_line(e: &ClientError) -> Option<String> {
    match e {
        ClientError::BrokenPipe => None,
        e => Some(format!("locker: {}", clean(&e.to_string()))),
    }
}

/// `s` on one line with every control character shown as `?` (newlines as spaces).
pub fn clean(s: &str) -> String {
    s.chars()
        .map(|c| match c {
            '\n' | '\r' | '\t' => ' ',
            c if c.is_control() => '?',
            c => c,
        })
        .collect()
}

/// A JSON value as a table cell: strings bare, null as `-`, the rest as compact JSON.
pub fn cell(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "-".to_string(),
        Some(Value::String(s)) if s.is_empty() => "-".to_string(),
        Some(Value::String(s)) => clean(s),
        Some(v) => clean(&v.to_string()),
    }
}

/// Left-aligned columns separated by two spaces, headers first; the last column is not
/// padded so that lines carry no trailing blanks.
pub fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, c) in row.iter().enumerate() {
            if i < widths.len() {
                widths[i] = widths[i].max(c.chars().count());
            }
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (i, c) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(c);
            } else {
                let pad = widths[i].saturating_sub(c.chars().count());
                line.push_str(c);
                line.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// A JSON object as `key: value` lines, nested objects flattened with dots
/// (`network.egress: none`); `first` names the keys to print before the others. Times
/// (keys ending in `_at`, `mtime`) get how long ago they were, relative to `now`.
pub fn kv_lines(v: &Value, first: &[&str], now: i64) -> String {
    let mut pairs = Vec::new();
    flatten("", v, &mut pairs);
    for (k, val) in &mut pairs {
        let is_time = k.ends_with("_at") || k.ends_with("mtime");
        if is_time && parse_rfc3339(val).is_some() {
            *val = format!("{val} ({})", relative(now, val));
        }
    }
    let rank = |k: &str| {
        let top = k.split('.').next().unwrap_or(k);
        first.iter().position(|f| *f == top).unwrap_or(first.len())
    };
    // A stable sort keeps the server's (alphabetical) order within each rank.
    pairs.sort_by_key(|(k, _)| rank(k));
    let width = pairs.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, val) in pairs {
        out.push_str(&format!("{k}:{}{val}\n", " ".repeat(width - k.len() + 1)));
    }
    out
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(map) if !map.is_empty() => {
            for (k, child) in map {
                let key = if prefix.is_empty() {
                    clean(k)
                } else {
                    format!("{prefix}.{}", clean(k))
                };
                flatten(&key, child, out);
            }
        }
        Value::Object(_) if prefix.is_empty() => {}
        Value::Object(_) => out.push((prefix.to_string(), "-".to_string())),
        Value::Array(items) if items.iter().all(|i| !i.is_object() && !i.is_array()) => {
            let parts: Vec<String> = items.iter().map(|i| cell(Some(i))).collect();
            let joined = if parts.is_empty() {
                "-".to_string()
            } else {
                parts.join(", ")
            };
            out.push((prefix.to_string(), joined));
        }
        // A list of flat records (a histogram's buckets): `k=v k=v; k=v k=v`, as text.
        Value::Array(items)
            if items.iter().all(|i| {
                i.as_object()
                    .is_some_and(|m| m.values().all(|v| !v.is_object() && !v.is_array()))
            }) =>
        {
            let parts: Vec<String> = items
                .iter()
                .filter_map(Value::as_object)
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| format!("{}={}", clean(k), cell(Some(v))))
                        .collect::<Vec<_>>()
                        .join(" ")
                })
                .collect();
            out.push((prefix.to_string(), parts.join("; ")));
        }
        other => out.push((prefix.to_string(), cell(Some(other)))),
    }
}

pub use locker_types::parse_rfc3339;

/// `t` relative to `now` for people: `5s ago`, `3m ago`, `in 27m`, `in 2h`, `4d ago`.
/// Anything that is not an RFC 3339 time is shown as it is.
pub fn relative(now: i64, t: &str) -> String {
    let Some(at) = parse_rfc3339(t) else {
        return clean(t);
    };
    let diff = at - now;
    let span = diff.unsigned_abs();
    let amount = match span {
        0..=1 => return "now".to_string(),
        2..=119 => format!("{span}s"),
        120..=7_199 => format!("{}m", span / 60),
        7_200..=172_799 => format!("{}h", span / 3600),
        _ => format!("{}d", span / 86_400),
    };
    if diff < 0 {
        format!("{amount} ago")
    } else {
        format!("in {amount}")
    }
}

/// Seconds since the Unix epoch now.
pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Permission bits as `ls -l` shows them, with the kind first: `drwxr-xr-x`.
pub fn mode_string(kind: &str, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        "dir" => 'd',
        "symlink" => 'l',
        "file" => '-',
        _ => '?',
    });
    let rwx = [b'r', b'w', b'x'];
    for i in (0..9).rev() {
        let bit = mode & (1 << i) != 0;
        s.push(if bit {
            char::from(rwx[(8 - i) % 3])
        } else {
            '-'
        });
    }
    // setuid, setgid and sticky show in the x columns, as ls does.
    let mut chars: Vec<char> = s.chars().collect();
    for (bit, col, set, unset) in [
        (0o4000, 3, 's', 'S'),
        (0o2000, 6, 's', 'S'),
        (0o1000, 9, 't', 'T'),
    ] {
        if mode & bit != 0 {
            chars[col] = if chars[col] == 'x' { set } else { unset };
        }
    }
    chars.into_iter().collect()
}

/// A byte count for people: `512`, `4.0K`, `12M`, `1.5G`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["K", "M", "G", "T", "P"];
    if n < 1024 {
        return n.to_string();
    }
    let mut v = n as f64;
    let mut unit = "";
    for u in UNITS {
        v /= 1024.0;
        unit = u;
        if v < 1024.0 {
            break;
        }
    }
    if v < 10.0 {
        format!("{v:.1}{unit}")
    } else {
        format!("{v:.0}{unit}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn errors_are_one_clean_line() {
        let e = ClientError::Protocol("bad\nthing\x1b[2J".into());
        assert_eq!(
            error_line(&e).unwrap(),
            "locker: unexpected answer from the server: bad thing?[2J"
        );
        assert!(error_line(&ClientError::BrokenPipe).is_none());
    }

    #[test]
    fn tables_align_and_carry_no_trailing_blanks() {
        let t = table(
            &["ID", "STATE", "TEMPLATE"],
            &[
                vec!["sb_1".into(), "running".into(), "default".into()],
                vec!["sb_12345".into(), "paused".into(), "-".into()],
            ],
        );
        assert_eq!(
            t,
            "ID        STATE    TEMPLATE\n\
             sb_1      running  default\n\
             sb_12345  paused   -\n"
        );
    }

    #[test]
    fn kv_lines_flatten_and_order() {
        let v = json!({"state": "running", "id": "sb_1", "network": {"egress": "none"},
                       "metadata": {}, "volumes": [], "cpus": 1,
                       "expires_at": "2026-11-30T12:27:00Z"});
        assert_eq!(
            kv_lines(&v, &["id", "state"], 1_796_040_000),
            "id:             sb_1\n\
             state:          running\n\
             cpus:           1\n\
             expires_at:     2026-11-30T12:27:00Z (in 27m)\n\
             metadata:       -\n\
             network.egress: none\n\
             volumes:        -\n"
        );
    }

    #[test]
    fn lists_of_records_read_as_text() {
        let v = json!({"gaps": [{"le": 0.1, "count": 2}, {"le": null, "count": 0}]});
        let text = kv_lines(&v, &[], 0);
        assert_eq!(text, "gaps: count=2 le=0.1; count=0 le=-\n");
        assert!(!text.contains('{') && !text.contains('"'));
    }

    #[test]
    fn rfc3339_round_trips_with_the_types_crate() {
        for secs in [0, 951_782_400, 1_796_040_000, -86_400, 4_102_444_800] {
            assert_eq!(parse_rfc3339(&locker_types::rfc3339(secs)), Some(secs));
        }
        assert_eq!(
            parse_rfc3339("2026-11-30T12:00:00.123456Z"),
            Some(1_796_040_000)
        );
        assert_eq!(
            parse_rfc3339("2026-11-30T14:00:00+02:00"),
            Some(1_796_040_000)
        );
        assert_eq!(parse_rfc3339("2026-11-30"), None);
        assert_eq!(parse_rfc3339("2026-13-30T12:00:00Z"), None);
        assert_eq!(parse_rfc3339("2026-11-30T12:00:00"), None);
    }

    #[test]
    fn relative_times_read_naturally() {
        let now = 1_796_040_000;
        assert_eq!(relative(now, "2026-11-30T12:00:00Z"), "now");
        assert_eq!(relative(now, "2026-11-30T11:59:15Z"), "45s ago");
        assert_eq!(relative(now, "2026-11-30T12:27:00Z"), "in 27m");
        assert_eq!(relative(now, "2026-11-30T09:00:00Z"), "3h ago");
        assert_eq!(relative(now, "2026-12-04T12:00:00Z"), "in 4d");
        assert_eq!(relative(now, "someday"), "someday");
    }

    #[test]
    fn modes_look_like_ls() {
        assert_eq!(mode_string("dir", 0o755), "drwxr-xr-x");
        assert_eq!(mode_string("file", 0o644), "-rw-r--r--");
        assert_eq!(mode_string("symlink", 0o777), "lrwxrwxrwx");
        assert_eq!(mode_string("file", 0o4755), "-rwsr-xr-x");
        assert_eq!(mode_string("dir", 0o1777), "drwxrwxrwt");
        assert_eq!(mode_string("file", 0o2644), "-rw-r-Sr--");
    }

    #[test]
    fn byte_counts_for_people() {
        assert_eq!(human_bytes(512), "512");
        assert_eq!(human_bytes(4096), "4.0K");
        assert_eq!(human_bytes(12 * 1024 * 1024), "12M");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024 / 2), "1.5G");
    }
}
