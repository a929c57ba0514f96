//! Teardown that also runs when a test fails: a guard holds an async clean-up job and runs it
//! from `Drop`, on a std thread of its own with a small current-thread tokio runtime (so it
//! works inside or outside the test's runtime, while unwinding too), and waits for it.
//!
//! Included by path (`#[path = ".../common/teardown.rs"]`) by the tests of every crate; it
//! uses no broker or database client itself. The broker guards are in `teardown_nats.rs`,
//! `teardown_rabbitmq.rs` and `teardown_kafka.rs`, the database guard in `mod.rs`.

#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

type BoxedJob = Pin<Box<dyn Future<Output = Result<(), String>>>>;
type Job = Box<dyn FnOnce() -> BoxedJob + Send>;

/// How long one clean-up may take before it is reported as left behind.
const TEARDOWN_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs its job once, when dropped (or at [`Teardown::run_now`]).
pub struct Teardown {
    what: String,
    job: Option<Job>,
}

impl Teardown {
    /// `what` names the resource in messages ("database sealpost_x", "stream T").
    pub fn new<F, Fut>(what: impl Into<String>, job: F) -> Teardown
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), String>> + 'static,
    {
        Teardown {
            what: what.into(),
            job: Some(Box::new(move || -> BoxedJob { Box::pin(job()) })),
        }
    }

    /// What this guard removes.
    pub fn what(&self) -> &str {
        &self.what
    }

    /// Runs the job now (the guard then does nothing); an `Err` names what was left behind.
    pub fn run_now(&mut self) -> Result<(), String> {
        let Some(job) = self.job.take() else {
            return Ok(());
        };
        let what = self.what.clone();
        let outcome = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("no runtime for the teardown: {e}"))?;
            rt.block_on(async {
                match tokio::time::timeout(TEARDOWN_TIMEOUT, job()).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("timed out after {TEARDOWN_TIMEOUT:?}")),
                }
            })
        })
        .join()
        .unwrap_or_else(|_| Err("the teardown panicked".to_string()));
        outcome.map_err(|e| format!("teardown of {what} failed, left behind: {e}"))
    }
}

impl Drop for Teardown {
    fn drop(&mut self) {
        if let Err(e) = self.run_now() {
            // A test that passed fails when it leaves something behind; one that is already
            // failing only reports it (a second panic would abort the test binary).
            if std::thread::panicking() {
                eprintln!("{e}");
            } else {
                panic!("{e}");
            }
        }
    }
}
