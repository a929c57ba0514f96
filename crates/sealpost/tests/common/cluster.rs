//! A private PostgreSQL 15 cluster for a test that needs a server configured differently from
//! the machine's shared one (TLS, `wal_level = logical`): `initdb` as `postgres` into a
//! temporary directory, on 127.0.0.1 and a free port. Dropping it stops it
//! (`pg_ctl stop -m immediate`) and removes the directory, also when the test fails. Without
//! the PostgreSQL 15 binaries [`Cluster::start`] prints "skipped" and returns `None`.

#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the PostgreSQL 15 binaries are.
pub const BIN: &str = "/usr/lib/postgresql/15/bin";

/// A private cluster; dropping it stops it and removes its directory.
pub struct Cluster {
    /// Its directory (data, log, socket).
    pub dir: PathBuf,
    /// Its port on 127.0.0.1.
    pub port: u16,
}

/// Writes `text` to `path` with permission bits `mode`.
pub fn write(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn postgres_ids() -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    (id("-u"), id("-g"))
}

fn as_postgres(dir: &Path, program: &str, args: &[&str]) -> std::process::Output {
    Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(format!("{BIN}/{program}"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Cluster {
    /// The data directory.
    pub fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Starts a cluster named by `tag` with `conf` appended to its postgresql.conf (after the
    /// port, socket directory and a small, unsynced setup) and `files` (name, text, mode)
    /// written into its data directory, owned by `postgres`. `None` (after printing
    /// "skipped") where PostgreSQL 15 is not installed, outside CI.
    pub fn start(tag: &str, conf: &str, files: &[(&str, &str, u32)]) -> Option<Cluster> {
        if !Path::new(BIN).join("initdb").exists() {
            // CI installs PostgreSQL 15: there a missing initdb is a failure, never a skip.
            assert!(
                std::env::var_os("CI").is_none(),
                "no {BIN}/initdb: the private-cluster tests cannot run"
            );
            eprintln!("skipped: no {BIN}/initdb");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("sealpost-pg-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let c = Cluster {
            dir: dir.clone(),
            port: free_port(),
        };
        let (uid, gid) = postgres_ids();
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid)).unwrap();
        let data = c.data();
        let out = as_postgres(
            &dir,
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
            ],
        );
        assert!(out.status.success(), "initdb: {out:?}");
        let own = |name: &str, text: &str, mode: u32| {
            let p = data.join(name);
            write(&p, text, mode);
            std::os::unix::fs::chown(&p, Some(uid), Some(gid)).unwrap();
        };
        for (name, text, mode) in files {
            own(name, text, *mode);
        }
        let base = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{dir}'\n\
             fsync = off\nmax_connections = 30\nshared_buffers = 16MB\n",
            port = c.port,
            dir = dir.display(),
        );
        let mut text = std::fs::read_to_string(data.join("postgresql.conf")).unwrap();
        text.push_str(&base);
        text.push_str(conf);
        own("postgresql.conf", &text, 0o600);
        c.pg_ctl_start();
        Some(c)
    }

    /// Starts the (stopped) server again.
    pub fn pg_ctl_start(&self) {
        let log = self.dir.join("log");
        let data = self.data();
        let out = as_postgres(
            &self.dir,
            "pg_ctl",
            &[
                "start",
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "30",
            ],
        );
        assert!(
            out.status.success(),
            "pg_ctl start: {out:?}\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
    }

    /// A connection string for `dbname` as `postgres` (key=value form).
    pub fn url(&self, dbname: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={dbname} connect_timeout=10",
            self.port
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.data().join("postmaster.pid").exists() {
            let _ = Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(format!("{BIN}/pg_ctl"))
                .arg("stop")
                .arg("-D")
                .arg(self.data())
                .args(["-m", "immediate", "-w", "-t", "20"])
                .current_dir(&self.dir)
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
