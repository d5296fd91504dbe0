//! Writing call records off the hot path.
//!
//! Owns: the queue between request handlers and the database, and the batching. An exec
//! must never wait on a disk write, so [`CallRecorder::record`] only puts the record in a
//! bounded queue (dropping it, counted and logged, when the queue is full: losing a record
//! under overload beats stalling every call), and one background task writes what has
//! queued up in batches, each in one transaction, on the blocking thread pool.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::model::CallRecord;
use crate::Store;

/// The most records one transaction writes.
pub const BATCH_MAX: usize = 256;
/// How long the first record of a batch waits for company before the batch is written.
pub const BATCH_WINDOW: Duration = Duration::from_millis(20);
/// Records the queue holds before `record` starts dropping.
pub const QUEUE_CAPACITY: usize = 16_384;

enum Msg {
    Record(Box<CallRecord>),
    Flush(oneshot::Sender<()>),
}

/// Counters for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecorderStats {
    /// Records stored.
    pub written: u64,
    /// Records refused because the queue was full (or the writer had stopped).
    pub dropped: u64,
    /// Records the database refused (logged with the reason).
    pub failed: u64,
    /// Transactions written.
    pub batches: u64,
}

#[derive(Debug, Default)]
struct Counters {
    written: AtomicU64,
    dropped: AtomicU64,
    failed: AtomicU64,
    batches: AtomicU64,
}

/// The handle request handlers record calls through. Cheap to clone; the background
/// writer stops once every clone is dropped, after writing what was queued.
#[derive(Debug, Clone)]
pub struct CallRecorder {
    tx: mpsc::Sender<Msg>,
    counters: Arc<Counters>,
}

impl CallRecorder {
    /// Starts the background writer on the current Tokio runtime with a queue of
    /// [`QUEUE_CAPACITY`] records.
    ///
    /// # Panics
    /// Outside a Tokio runtime.
    pub fn spawn(store: Arc<dyn Store>) -> CallRecorder {
        CallRecorder::spawn_with_capacity(store, QUEUE_CAPACITY)
    }

    /// [`CallRecorder::spawn`] with a queue of `capacity` records (at least 1).
    pub fn spawn_with_capacity(store: Arc<dyn Store>, capacity: usize) -> CallRecorder {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let counters = Arc::new(Counters::default());
        tokio::spawn(run(store, rx, Arc::clone(&counters)));
        CallRecorder { tx, counters }
    }

    /// Queues a record; never blocks or waits. Output bodies are dropped here already,
    /// so the queue holds no output. When the queue is full the record is dropped and
    /// counted in [`RecorderStats::dropped`].
    pub fn record(&self, mut call: CallRecord) {
        call.strip_output();
        if let Err(e) = self.tx.try_send(Msg::Record(Box::new(call))) {
            let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            // Log the 1st, 1001st, 2001st… drop, not every one: under overload a
            // log line per call would add to the overload.
            if n % 1000 == 1 {
                let why = match e {
                    mpsc::error::TrySendError::Full(_) => {
                        "queue full: the database is slower than the calls"
                    }
                    mpsc::error::TrySendError::Closed(_) => "the writer task has stopped",
                };
                tracing::warn!(dropped_total = n, "call record dropped: {why}");
            }
        }
    }

    /// Waits until every record queued before this call is written (or failed).
    /// Used on graceful shutdown and by tests.
    pub async fn flush(&self) {
        let (done_tx, done_rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(done_tx)).await.is_ok() {
            // An error here means the writer stopped: nothing more can be written anyway.
            let _ = done_rx.await;
        }
    }

    /// The counters so far.
    pub fn stats(&self) -> RecorderStats {
        RecorderStats {
            written: self.counters.written.load(Ordering::Relaxed),
            dropped: self.counters.dropped.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
            batches: self.counters.batches.load(Ordering::Relaxed),
        }
    }
}

/// The background writer: gathers up to [`BATCH_MAX`] records, waiting at most
/// [`BATCH_WINDOW`] after the first, writes them, answers flushes, repeats.
async fn run(store: Arc<dyn Store>, mut rx: mpsc::Receiver<Msg>, counters: Arc<Counters>) {
    let mut batch: Vec<CallRecord> = Vec::with_capacity(BATCH_MAX);
    let mut flushes: Vec<oneshot::Sender<()>> = Vec::new();
    while let Some(first) = rx.recv().await {
        match first {
            Msg::Record(call) => {
                batch.push(*call);
                let deadline = Instant::now() + BATCH_WINDOW;
                while batch.len() < BATCH_MAX {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(Msg::Record(call))) => batch.push(*call),
                        Ok(Some(Msg::Flush(done))) => {
                            flushes.push(done);
                            break;
                        }
                        // Closed (the last handle is gone) or the window passed.
                        Ok(None) | Err(_) => break,
                    }
                }
            }
            Msg::Flush(done) => flushes.push(done),
        }
        if !batch.is_empty() {
            let full = std::mem::replace(&mut batch, Vec::with_capacity(BATCH_MAX));
            write(&store, full, &counters).await;
        }
        for done in flushes.drain(..) {
            let _ = done.send(());
        }
    }
}

/// Writes one batch in one transaction. If the database refuses it (a duplicate id, a bad
/// time), writes the records one by one so one bad record costs only itself.
async fn write(store: &Arc<dyn Store>, batch: Vec<CallRecord>, counters: &Counters) {
    let n = batch.len() as u64;
    let store2 = Arc::clone(store);
    let outcome = tokio::task::spawn_blocking(move || {
        let first = store2.insert_calls(&batch);
        (batch, first)
    })
    .await;
    let (batch, err) = match outcome {
        Ok((_, Ok(()))) => {
            counters.written.fetch_add(n, Ordering::Relaxed);
            counters.batches.fetch_add(1, Ordering::Relaxed);
            return;
        }
        Ok((batch, Err(e))) => (batch, e),
        Err(join) => {
            counters.failed.fetch_add(n, Ordering::Relaxed);
            tracing::error!(records = n, "writing call records panicked: {join}");
            return;
        }
    };
    tracing::warn!(
        records = n,
        "a batch of call records was refused ({err}); writing them one by one"
    );
    let store2 = Arc::clone(store);
    let outcome = tokio::task::spawn_blocking(move || {
        let mut written = 0u64;
        for call in &batch {
            match store2.insert_calls(std::slice::from_ref(call)) {
                Ok(()) => written += 1,
                Err(e) => tracing::error!(call_id = %call.id, "call record not stored: {e}"),
            }
        }
        written
    })
    .await;
    let written = outcome.unwrap_or(0);
    counters.written.fetch_add(written, Ordering::Relaxed);
    counters.failed.fetch_add(n - written, Ordering::Relaxed);
    counters.batches.fetch_add(written, Ordering::Relaxed);
}
