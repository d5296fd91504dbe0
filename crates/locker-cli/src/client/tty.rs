//! The local terminal for `locker shell` and `locker exec`: raw mode, window size, signals
//! as readable bytes, `poll(2)` and unbuffered reads, by the names the client commands use.
//!
//! The system calls and their `unsafe` live in `locker-sys` (`term`, `fd`); the CLI itself
//! forbids `unsafe`. Unbuffered reads matter: std's `Stdin` buffers, which would hide bytes
//! from `poll`.

pub use locker_sys::fd::{poll, read as read_fd};
pub use locker_sys::term::{on_interrupt, window_size, RawMode, Signals};
