//! One output stream of a command, kept in O(cap) memory.
//!
//! The result shows at most `max_output_bytes` of each stream: the head and the tail (about
//! half each) with a marker line between them. The full stream goes to a spill file (from byte
//! 0) once it outgrows the cap, or from the start for background processes, whose spool files
//! are replayed by `ProcessOutput`. Past the hard spill limit the file stops growing and the
//! caller is told to kill the command (`output_limit`).

use std::collections::VecDeque;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

/// A capped capture of one stream.
pub struct Capture {
    head: Vec<u8>,
    head_cap: usize,
    tail: VecDeque<u8>,
    tail_cap: usize,
    total: u64,
    spill_path: Option<PathBuf>,
    spill: Option<File>,
    spill_always: bool,
    spill_failed: bool,
    spilled: u64,
    spill_limit: u64,
}

/// What the caller should do after a push.
#[derive(Debug, PartialEq, Eq)]
pub enum Pushed {
    Ok,
    /// The stream passed the spill limit: kill the command.
    OverLimit,
}

impl Capture {
    /// A capture keeping `cap` bytes in memory. With `spill_always` the file at `spill_path`
    /// gets everything from the start; otherwise only once the stream outgrows `cap`.
    pub fn new(
        cap: u64,
        spill_path: Option<PathBuf>,
        spill_always: bool,
        spill_limit: u64,
    ) -> Capture {
        let cap = usize::try_from(cap).unwrap_or(usize::MAX / 4).max(1);
        let head_cap = cap / 2;
        let mut c = Capture {
            head: Vec::new(),
            head_cap,
            tail: VecDeque::new(),
            tail_cap: cap - head_cap,
            total: 0,
            spill_path,
            spill: None,
            spill_always,
            spill_failed: false,
            spilled: 0,
            spill_limit,
        };
        if spill_always {
            c.open_spill();
        }
        c
    }

    fn cap(&self) -> u64 {
        (self.head_cap + self.tail_cap) as u64
    }

    /// Bytes produced so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Bytes written to the spill file so far.
    pub fn spilled(&self) -> u64 {
        self.spilled
    }

    /// Whether the stream outgrew the cap.
    pub fn truncated(&self) -> bool {
        self.total > self.cap()
    }

    /// The spill file, if one holds the stream.
    pub fn spill_file(&self) -> Option<&Path> {
        if self.spill_failed || (self.spill.is_none() && self.spilled == 0) {
            return None;
        }
        self.spill_path.as_deref()
    }

    fn open_spill(&mut self) {
        let Some(path) = &self.spill_path else {
            self.spill_failed = true;
            return;
        };
        if let Some(dir) = path.parent() {
            let _ = fs::create_dir_all(dir);
        }
        match File::create(path) {
            Ok(f) => self.spill = Some(f),
            Err(e) => {
                eprintln!(
                    "locker-agent: cannot create spill file {}: {e}",
                    path.display()
                );
                self.spill_failed = true;
            }
        }
    }

    fn write_spill(&mut self, data: &[u8]) -> Pushed {
        let room = self.spill_limit.saturating_sub(self.spilled);
        let n = (data.len() as u64).min(room) as usize;
        if let Some(f) = &mut self.spill {
            if let Err(e) = f.write_all(&data[..n]) {
                eprintln!("locker-agent: spill file write failed: {e}");
                self.spill = None;
                self.spill_failed = true;
            } else {
                self.spilled += n as u64;
            }
        }
        if n < data.len() {
            Pushed::OverLimit
        } else {
            Pushed::Ok
        }
    }

    /// Adds bytes the command wrote.
    pub fn push(&mut self, data: &[u8]) -> Pushed {
        let was_truncated = self.truncated();
        let mut data = data;
        // Fill the head first.
        let head_room = self.head_cap.saturating_sub(self.head.len());
        let to_head = head_room.min(data.len());
        let mut outcome = Pushed::Ok;
        let newly_over = !was_truncated && self.total + data.len() as u64 > self.cap();
        if newly_over && !self.spill_always && !self.spill_failed {
            // Everything so far is still in memory (head + tail): write it out first.
            self.open_spill();
            let mut old: Vec<u8> = Vec::with_capacity(self.head.len() + self.tail.len());
            old.extend_from_slice(&self.head);
            old.extend(self.tail.iter());
            if self.write_spill(&old) == Pushed::OverLimit {
                outcome = Pushed::OverLimit;
            }
        }
        if self.spill.is_some() && self.write_spill(data) == Pushed::OverLimit {
            outcome = Pushed::OverLimit;
        }
        self.total += data.len() as u64;
        self.head.extend_from_slice(&data[..to_head]);
        data = &data[to_head..];
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
        } else {
            let excess = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
            self.tail.drain(..excess);
            self.tail.extend(data);
        }
        outcome
    }

    /// Makes sure a spill file holds the whole stream (when it never outgrew the cap, all of it
    /// is still in memory). Used when the result must show less than the cap.
    pub fn ensure_spilled(&mut self) {
        if self.spill.is_some() || self.spilled > 0 || self.spill_failed || self.truncated() {
            return;
        }
        self.open_spill();
        let mut all: Vec<u8> = Vec::with_capacity(self.head.len() + self.tail.len());
        all.extend_from_slice(&self.head);
        all.extend(self.tail.iter());
        let _ = self.write_spill(&all);
    }

    /// Flushes the spill file to the disk's cache (readers see everything written).
    pub fn finish(&mut self) {
        if let Some(f) = &mut self.spill {
            let _ = f.flush();
        }
    }

    /// The text the result shows: [`Capture::render_bytes`] as lossy UTF-8.
    #[cfg(test)]
    pub fn render(&self, budget: usize) -> String {
        String::from_utf8_lossy(&self.render_bytes(budget)).into_owned()
    }

    /// The bytes the result shows: everything when it fits `budget` bytes, else the head and
    /// the tail with a marker line between them. Cut points avoid splitting UTF-8
    /// characters, so text output stays valid text.
    pub fn render_bytes(&self, budget: usize) -> Vec<u8> {
        let budget = budget.min(self.head_cap + self.tail_cap);
        if self.total <= budget as u64 {
            let mut all = self.head.clone();
            all.extend(self.tail.iter());
            return all;
        }
        let want_head = budget / 2;
        let want_tail = budget - want_head;
        let mut head = self.prefix(want_head);
        let mut tail = self.suffix(want_tail);
        let keep = utf8_complete_len(&head);
        head.truncate(keep);
        let skip = utf8_continuation_prefix(&tail);
        tail.drain(..skip);
        let omitted = self.total - head.len() as u64 - tail.len() as u64;
        let mut out = head;
        if !out.is_empty() && !out.ends_with(b"\n") {
            out.push(b'\n');
        }
        out.extend_from_slice(format!("…[locker: {omitted} bytes omitted]…\n").as_bytes());
        out.extend_from_slice(&tail);
        out
    }

    fn prefix(&self, n: usize) -> Vec<u8> {
        let mut v: Vec<u8> = self.head.iter().copied().take(n).collect();
        if v.len() < n {
            v.extend(self.tail.iter().take(n - v.len()));
        }
        v
    }

    fn suffix(&self, n: usize) -> Vec<u8> {
        let from_tail = n.min(self.tail.len());
        let mut v: Vec<u8> = Vec::with_capacity(n);
        if from_tail < n && !self.truncated() {
            // No gap: the rest comes from the end of the head.
            let more = (n - from_tail).min(self.head.len());
            v.extend_from_slice(&self.head[self.head.len() - more..]);
        }
        v.extend(self.tail.iter().skip(self.tail.len() - from_tail));
        v
    }
}

/// The length of `b` without a trailing, incomplete UTF-8 sequence.
fn utf8_complete_len(b: &[u8]) -> usize {
    let n = b.len();
    for back in 1..=n.min(4) {
        let c = b[n - back];
        if c & 0xC0 == 0x80 {
            continue;
        }
        let need = match c {
            0xF0..=0xF7 => 4,
            0xE0..=0xEF => 3,
            0xC0..=0xDF => 2,
            _ => 1,
        };
        return if need > back { n - back } else { n };
    }
    n
}

/// How many continuation bytes (at most 3) `b` starts with.
fn utf8_continuation_prefix(b: &[u8]) -> usize {
    b.iter().take(3).take_while(|&&c| c & 0xC0 == 0x80).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("locker-capture-{}-{name}", std::process::id()))
    }

    #[test]
    fn small_output_is_kept_whole_and_not_spilled() {
        let p = tmp("small");
        let mut c = Capture::new(10, Some(p.clone()), false, 1 << 20);
        assert_eq!(c.push(b"hello"), Pushed::Ok);
        assert_eq!(c.push(b"12345"), Pushed::Ok);
        assert_eq!(c.render(10), "hello12345");
        assert!(!c.truncated());
        assert!(c.spill_file().is_none());
        assert!(!p.exists());
    }

    #[test]
    fn large_output_keeps_head_tail_and_spills_everything() {
        let p = tmp("large");
        let mut c = Capture::new(8, Some(p.clone()), false, 1 << 20);
        let data: Vec<u8> = (0..100u8).map(|i| b'a' + i % 26).collect();
        for chunk in data.chunks(7) {
            assert_eq!(c.push(chunk), Pushed::Ok);
        }
        c.finish();
        assert!(c.truncated());
        assert_eq!(c.total(), 100);
        let text = c.render(8);
        assert_eq!(text, "abcd\n…[locker: 92 bytes omitted]…\nstuv");
        assert_eq!(fs::read(&p).unwrap(), data);
        fs::remove_file(p).unwrap();
    }

    #[test]
    fn spill_limit_reports_over_limit_and_bounds_the_file() {
        let p = tmp("limit");
        let mut c = Capture::new(4, Some(p.clone()), false, 10);
        assert_eq!(c.push(b"0123"), Pushed::Ok);
        assert_eq!(c.push(b"456789"), Pushed::Ok);
        assert_eq!(c.push(b"abc"), Pushed::OverLimit);
        assert_eq!(fs::read(&p).unwrap(), b"0123456789");
        fs::remove_file(p).unwrap();
    }

    #[test]
    fn cuts_never_split_a_character() {
        let mut c = Capture::new(6, None, false, 0);
        c.push("ééééééé".as_bytes()); // 14 bytes of two-byte characters
        let t = c.render(6);
        assert!(!t.contains('\u{FFFD}'), "{t:?}");
        assert!(t.starts_with('é') && t.ends_with('é'), "{t:?}");
    }

    #[test]
    fn smaller_budget_renders_from_memory() {
        let mut c = Capture::new(100, None, false, 0);
        c.push(b"0123456789");
        assert_eq!(c.render(4), "01\n…[locker: 6 bytes omitted]…\n89");
    }
}
