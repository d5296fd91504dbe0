//! What a build reports as it goes: a trait, a silent reporter and one for a terminal.

use std::io::{self, IsTerminal, Write};
use std::time::{Duration, Instant};

/// Where a build or import reports how far it got.
pub trait Progress {
    /// A new step began (`name` is for a person); `fraction` is the whole job's
    /// completion, from 0.0 to 1.0.
    fn step(&mut self, name: &str, fraction: f64);
    /// The job moved inside the current step.
    fn fraction(&mut self, fraction: f64);
    /// One line of a tool's output (mmdebstrap, apt, a run step, tar).
    fn output(&mut self, _line: &str) {}
    /// The job ended, well or not (called once by [`TemplateStore::build`] and
    /// [`TemplateStore::import`], also when they return at once).
    fn finish(&mut self, _ok: bool) {}
}

/// A [`Progress`] that reports nothing.
#[derive(Debug, Default)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn step(&mut self, _name: &str, _fraction: f64) {}
    fn fraction(&mut self, _fraction: f64) {}
}

/// A [`Progress`] on standard error: a bar redrawn in place when stderr is a terminal,
/// one line per step otherwise.
#[derive(Debug)]
pub struct StderrProgress {
    pub(super) tty: bool,
    pub(super) verbose: bool,
    pub(super) step: String,
    pub(super) fraction: f64,
    pub(super) drawn: Option<Instant>,
    pub(super) started: Instant,
}

impl StderrProgress {
    /// `verbose` also prints every line of the tools' output.
    pub fn new(verbose: bool) -> Self {
        StderrProgress {
            tty: io::stderr().is_terminal(),
            verbose,
            step: String::new(),
            fraction: 0.0,
            drawn: None,
            started: Instant::now(),
        }
    }

    pub(super) fn draw(&mut self, force: bool) {
        if !self.tty {
            return;
        }
        if !force
            && self
                .drawn
                .is_some_and(|t| t.elapsed() < Duration::from_millis(80))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        const WIDTH: usize = 28;
        let filled = ((self.fraction * WIDTH as f64).round() as usize).min(WIDTH);
        let step: String = self.step.chars().take(60).collect();
        let secs = self.started.elapsed().as_secs();
        eprint!(
            "\r\x1b[2K[{}{}] {:>3}% {:>3}s {step}",
            "#".repeat(filled),
            " ".repeat(WIDTH - filled),
            (self.fraction * 100.0).floor() as u32,
            secs
        );
        let _ = io::stderr().flush();
    }
}

impl Progress for StderrProgress {
    fn step(&mut self, name: &str, fraction: f64) {
        self.step = name.to_string();
        self.fraction = fraction.clamp(0.0, 1.0);
        if self.tty {
            self.draw(true);
        } else {
            eprintln!("[{:>3}%] {name}", (self.fraction * 100.0).floor() as u32);
        }
    }

    fn fraction(&mut self, fraction: f64) {
        self.fraction = fraction.clamp(0.0, 1.0);
        self.draw(false);
    }

    fn output(&mut self, line: &str) {
        if self.verbose {
            if self.tty {
                eprint!("\r\x1b[2K");
            }
            eprintln!("  {line}");
            self.draw(true);
        }
    }

    fn finish(&mut self, ok: bool) {
        if self.tty {
            if ok {
                self.fraction = 1.0;
            }
            self.draw(true);
            eprintln!();
        }
    }
}
