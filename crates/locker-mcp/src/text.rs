//! The text operations of the tools, without I/O: file_edit's exact `str_replace` and
//! `insert`, and process_output's tail of a stream.
//!
//! Pure functions on strings (tested here); `server.rs` reads and writes the files.

/// The last `cap` bytes of `b` as text (cut on a char boundary), and whether it was cut.
pub(crate) fn tail(b: &[u8], cap: usize) -> (String, bool) {
    if b.len() <= cap {
        return (String::from_utf8_lossy(b).into_owned(), false);
    }
    let s = String::from_utf8_lossy(&b[b.len() - cap..]).into_owned();
    (
        format!("…[locker: first {} bytes omitted]…\n{s}", b.len() - cap),
        true,
    )
}

/// The 1-based line numbers where `needle` starts in `text`.
fn match_lines(text: &str, needle: &str) -> Vec<usize> {
    text.match_indices(needle)
        .map(|(i, _)| text[..i].matches('\n').count() + 1)
        .collect()
}

/// Replaces the one occurrence of `old`; returns the new text and the first changed line.
pub fn str_replace(text: &str, old: &str, new: &str) -> Result<(String, usize), String> {
    if old.is_empty() {
        return Err("old_str is empty; give the exact text to replace".into());
    }
    let at = match_lines(text, old);
    match at.len() {
        1 => {
            let i = text.find(old).expect("one match");
            let mut out = String::with_capacity(text.len() + new.len());
            out.push_str(&text[..i]);
            out.push_str(new);
            out.push_str(&text[i + old.len()..]);
            Ok((out, at[0]))
        }
        0 => {
            let hint = if text.contains(old.trim()) && !old.trim().is_empty() {
                " (it does occur with different leading/trailing whitespace: copy the exact text, indentation and line breaks included)"
            } else {
                " (read the file with file_read to copy the exact text)"
            };
            Err(format!("old_str does not occur in the file; nothing was changed{hint}"))
        }
        n => Err(format!(
            "old_str occurs {n} times (starting on lines {}); it must occur exactly once, nothing was changed: include more surrounding lines to make it unique",
            at.iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Inserts `new` after line `after` (0 = top); returns the new text and its first line.
pub fn insert(text: &str, after: usize, new: &str) -> Result<(String, usize), String> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    if after > lines.len() {
        return Err(format!(
            "insert_line {after} is past the end: the file has {} lines (use {} to append)",
            lines.len(),
            lines.len()
        ));
    }
    let mut out = String::with_capacity(text.len() + new.len() + 2);
    for l in &lines[..after] {
        out.push_str(l);
    }
    if after > 0 && !out.ends_with('\n') {
        out.push('\n');
    }
    out.push_str(new);
    if !new.ends_with('\n') {
        out.push('\n');
    }
    for l in &lines[after..] {
        out.push_str(l);
    }
    Ok((out, after + 1))
}

#[cfg(test)]
mod tests {
    use super::{insert, str_replace, tail};

    #[test]
    fn str_replace_needs_exactly_one_exact_match() {
        let t = "a = 1\nb = 2\n    c = 3\n";
        assert_eq!(
            str_replace(t, "b = 2", "b = 20").unwrap(),
            ("a = 1\nb = 20\n    c = 3\n".into(), 2)
        );
        let e = str_replace(t, "c = 3\n    ", "x").unwrap_err();
        assert!(e.contains("does not occur"), "{e}");
        let e = str_replace(t, "  c = 3", "x").unwrap();
        assert_eq!(e.1, 3);
        let e = str_replace("x\nx\n", "x", "y").unwrap_err();
        assert!(e.contains("2 times") && e.contains("lines 1, 2"), "{e}");
        let e = str_replace(t, "c  = 3", "x").unwrap_err();
        assert!(e.contains("nothing was changed"), "{e}");
    }

    #[test]
    fn insert_counts_lines_from_one_and_zero_is_top() {
        let t = "one\ntwo\n";
        assert_eq!(
            insert(t, 0, "zero").unwrap(),
            ("zero\none\ntwo\n".into(), 1)
        );
        assert_eq!(insert(t, 1, "1.5\n").unwrap().0, "one\n1.5\ntwo\n");
        assert_eq!(insert(t, 2, "three").unwrap().0, "one\ntwo\nthree\n");
        assert_eq!(insert("no newline", 1, "x").unwrap().0, "no newline\nx\n");
        assert!(insert(t, 3, "x").unwrap_err().contains("past the end"));
    }

    #[test]
    fn tail_keeps_the_end() {
        assert_eq!(tail(b"abc", 10), ("abc".into(), false));
        let (s, t) = tail(b"0123456789", 4);
        assert!(
            t && s.ends_with("6789") && s.contains("6 bytes omitted"),
            "{s}"
        );
    }
}
