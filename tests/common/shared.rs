//! One `locker serve` shared by the tests of a test binary, and a tenant of its own for each
//! test on it.
//!
//! Starting a server is a process, a fresh data dir and a warm pool of machines it builds at
//! once; most end-to-end tests only need *a* server, not a fresh one. [`shared`] starts one
//! on first use and registers an exit handler (`atexit`) that shuts it down when the binary
//! ends, whether its tests passed or failed (libtest returns from `main` or calls
//! `process::exit`, and both run the handler); a static's destructor would never run. Each
//! test takes a [`Tenant`] of its own, so what it lists, its calls and its usage are its
//! alone while other tests run beside it, and the tenant's sandboxes are deleted when the
//! test ends, passed or failed (in the background, joined before the shutdown; the
//! server's log is printed when it failed).
//!
//! Tests that need a fresh server (a restart, a kill, its own flags, server-wide counters)
//! start their own [`Server`]. This module must not leave a machine, mount, cgroup or
//! process behind once the binary has exited, and never touches another binary's server.

use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use serde_json::{json, Value};

use crate::server::{delete_all_of, Api, Server};
use crate::unique;

static SHARED: OnceLock<Server> = OnceLock::new();

/// The deletions of ended tests' sandboxes still under way (joined before the shutdown).
static CLEANUPS: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// The server shared by this test binary's tests (started on first use, shut down at exit).
pub fn shared() -> &'static Server {
    SHARED.get_or_init(|| {
        let srv = Server::start();
        // SAFETY: atexit with a plain `extern "C"` function that takes no arguments.
        let rc = unsafe { libc::atexit(shut_down_shared) };
        assert_eq!(rc, 0, "register the shared server's shutdown at exit");
        srv
    })
}

extern "C" fn shut_down_shared() {
    // The exiting thread's thread-locals are already destroyed when exit handlers run, and
    // std and tokio use thread-locals: the shutdown runs on a fresh thread. A panic in it is
    // reported by the join and must not unwind into C.
    let done = std::thread::spawn(|| {
        let pending = std::mem::take(&mut *CLEANUPS.lock().unwrap_or_else(|e| e.into_inner()));
        for h in pending {
            let _ = h.join();
        }
        if let Some(srv) = SHARED.get() {
            srv.shut_down();
        }
    })
    .join();
    if done.is_err() {
        eprintln!("the shared server's shutdown panicked: see above");
    }
}

/// A tenant of its own for one test on the shared server: created through the admin
/// route, and its sandboxes deleted on drop.
pub struct Tenant {
    pub srv: &'static Server,
    /// The tenant's name (`default` for [`Tenant::default_tenant`]).
    pub name: String,
    pub key: String,
    pub key_id: Option<String>,
    api: Api,
}

impl Tenant {
    /// A new tenant on the shared server.
    pub fn new() -> Tenant {
        let srv = shared();
        let name = unique("t");
        let v = srv
            .admin()
            .post("/v1/tenants", &json!({ "name": name }))
            .expect(201, "create a tenant for the test");
        let key = v["api_key"].as_str().expect("api_key").to_owned();
        Tenant {
            srv,
            name,
            api: srv.api_with(&key),
            key,
            key_id: Some(v["key_id"].as_str().expect("key_id").to_owned()),
        }
    }

    /// Tenant `default` of the shared server: for the one test of a binary that checks what
    /// the server says of its default tenant. No other test of that binary may use it.
    pub fn default_tenant() -> Tenant {
        let srv = shared();
        Tenant {
            srv,
            name: "default".into(),
            key: srv.api_key.clone(),
            key_id: None,
            api: srv.api(),
        }
    }

    /// A client with this tenant's key.
    pub fn api(&self) -> Api {
        self.api.clone()
    }

    /// Creates a sandbox of this tenant (201) and returns its id.
    #[track_caller]
    pub fn sandbox(&self, body: &Value) -> String {
        crate::answers::sandbox_id(&self.api.create_sandbox(body))
    }
}

impl Default for Tenant {
    fn default() -> Self {
        Tenant::new()
    }
}

impl Drop for Tenant {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "tenant {} of the shared server; the log shows every test's lines",
                self.name
            );
            self.srv.print_log_tail();
        }
        // The deletes run beside the next tests rather than in this one's time; the
        // shutdown at exit waits for them, then deletes whatever is left.
        let (api, name) = (self.api.clone(), self.name.clone());
        let h = std::thread::spawn(move || {
            let failed = delete_all_of(&api);
            if !failed.is_empty() {
                eprintln!("cleanup of tenant {name}: delete failed for {failed:?}");
            }
        });
        CLEANUPS.lock().unwrap_or_else(|e| e.into_inner()).push(h);
    }
}

/// A sandbox several tests of a module share, on a tenant of its own: for tests that only
/// run commands, or touch paths of their own, in it (each sandbox is a machine to start).
/// It lives until the binary exits, when the shared server's shutdown deletes it.
pub struct SharedSandbox {
    pub tenant: Tenant,
    pub id: String,
}

impl SharedSandbox {
    /// The sandbox in `cell`, created with `body` on first use, for one test.
    pub fn borrow(cell: &'static OnceLock<SharedSandbox>, body: &Value) -> Borrowed {
        let s = cell.get_or_init(|| {
            let tenant = Tenant::new();
            let id = tenant.sandbox(body);
            SharedSandbox { tenant, id }
        });
        Borrowed {
            srv: s.tenant.srv,
            api: s.tenant.api(),
            id: s.id.clone(),
            key: s.tenant.key.clone(),
        }
    }
}

/// One test's use of a [`SharedSandbox`]: prints the shared server's log if the test fails.
pub struct Borrowed {
    pub srv: &'static Server,
    pub api: Api,
    pub id: String,
    pub key: String,
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "shared sandbox {}; the log shows every test's lines",
                self.id
            );
            self.srv.print_log_tail();
        }
    }
}

/// Prints the shared server's log if the test holding it fails: for a test that uses only
/// fixtures of its module (no [`Tenant`] or [`Borrowed`] of its own).
pub struct LogOnFailure;

impl Drop for LogOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(srv) = SHARED.get() {
                eprintln!("the shared server's log shows every test's lines");
                srv.print_log_tail();
            }
        }
    }
}
