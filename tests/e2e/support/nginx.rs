//! A real nginx (Debian's nginx-light) in front of an upstream, as the proxy between the gateway
//! and an application: it answers 502 when the application drops the connection and 504 when it
//! outlives `proxy_read_timeout`. Its own prefix directory, a free port, stopped on drop.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::TempDir;

pub struct Nginx {
    pub port: u16,
    child: Child,
    _dir: TempDir,
}

fn binary() -> &'static str {
    ["/usr/sbin/nginx", "/usr/bin/nginx"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .expect(
            "nginx is needed for this test (apt-get install nginx-light; scripts/test installs it)",
        )
}

impl Nginx {
    /// nginx on a free loopback port, proxying everything to `127.0.0.1:upstream` with this
    /// `proxy_read_timeout`.
    // Blocking, as process management is here: called before a test's async part.
    #[allow(clippy::disallowed_methods)]
    pub fn start(upstream: u16, read_timeout: Duration) -> Nginx {
        let dir = TempDir::new("nginx");
        let port = super::redis::free_port(false);
        let p = dir.path.display();
        let conf = format!(
            "daemon off;\nmaster_process off;\npid {p}/nginx.pid;\nerror_log {p}/error.log;\n\
             events {{ worker_connections 64; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {p}/body;\n  proxy_temp_path {p}/proxy;\n\
               fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  scgi_temp_path {p}/scgi;\n\
               server {{\n    listen 127.0.0.1:{port};\n    location / {{\n\
                 proxy_pass http://127.0.0.1:{upstream};\n      proxy_http_version 1.1;\n\
                 proxy_read_timeout {}ms;\n      proxy_next_upstream off;\n    }}\n  }}\n}}\n",
            read_timeout.as_millis()
        );
        let path = dir.path.join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let child = Command::new(binary())
            .arg("-p")
            .arg(&dir.path)
            .arg("-e")
            .arg(dir.path.join("error.log"))
            .arg("-c")
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "nginx did not listen within 10s: {}",
                std::fs::read_to_string(dir.path.join("error.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        Nginx {
            port,
            child,
            _dir: dir,
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
