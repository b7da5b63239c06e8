//! A real headless Chromium for the console's tests, driven over WebDriver: each [`Browser`]
//! starts its own `chromedriver` on a free port (which starts Chromium with a fresh profile) and
//! stops both when the test ends, leaving no process behind. A missing browser fails the test with
//! the Debian packages to install.
//!
//! Tests wait on facts in the page ([`Browser::wait_js`]), never on time. A test body wrapped in
//! [`Browser::run`] saves a screenshot of every open page into a kept temp dir when it fails.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use futures_util::FutureExt;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tempfile::TempDir;

use crate::helpers::{Patience, poll_until, poll_until_with};

/// The Debian packages that provide what these tests drive.
const PACKAGES: &str = "`chromium` and `chromium-driver`";

/// Where Debian puts the browser (the real binary, then its launcher script) and the driver.
const CHROMIUM: &[&str] = &["/usr/lib/chromium/chromium", "/usr/bin/chromium"];
const CHROMEDRIVER: &[&str] = &["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"];

/// The first of `candidates` that exists, else `name` on the PATH.
fn program(name: &str, candidates: &[&str]) -> Option<PathBuf> {
    candidates
        .iter()
        .map(PathBuf::from)
        .find(|path| path.is_file())
        .or_else(|| {
            let paths = std::env::var_os("PATH")?;
            std::env::split_paths(&paths)
                .map(|dir| dir.join(name))
                .find(|path| path.is_file())
        })
}

pub fn required(name: &str, candidates: &[&str]) -> PathBuf {
    program(name, candidates).unwrap_or_else(|| {
        panic!(
            "the console's browser tests need headless Chromium and its WebDriver, but `{name}` was \
             not found (looked at {candidates:?} and the PATH): install the Debian packages \
             {PACKAGES} (`apt-get install chromium chromium-driver`, or run scripts/test, which \
             installs them)"
        )
    })
}

/// A free loopback port, for a process that takes its port on the command line.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port")
        .port()
}

/// Kills a process group we started (the child and everything it started) and reaps the child.
fn kill_group(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stderr(Stdio::null())
        .status();
    let _ = child.wait();
}

/// Whether any process of the group led by `pid` is still alive.
fn group_alive(pid: u32) -> bool {
    Command::new("kill")
        .args(["-0", "--", &format!("-{pid}")])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// A headless Chromium session with its own chromedriver.
pub struct Browser {
    pub client: Client,
    driver: Child,
    /// The profile, the driver's log and, on failure, the screenshots.
    dir: TempDir,
    test: String,
}

impl Browser {
    /// A browser for the test called `test`, with a 1280×900 viewport.
    pub async fn start(test: &str) -> Browser {
        Browser::start_with(test, &[]).await
    }

    /// A browser with extra Chromium arguments (e.g. `--host-resolver-rules`).
    pub async fn start_with(test: &str, extra: &[String]) -> Browser {
        let chromium = required("chromium", CHROMIUM);
        let chromedriver = required("chromedriver", CHROMEDRIVER);
        let dir = tempfile::Builder::new()
            .prefix("console-browser-")
            .tempdir()
            .expect("temp dir");
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("chromedriver.log")).expect("driver log");
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            // Its own process group: the test can end the driver and every browser process with
            // one signal, and never signals itself.
            .process_group(0)
            .spawn()
            .unwrap_or_else(|error| panic!("start {}: {error}", chromedriver.display()));
        let mut guard = DriverGuard(Some(driver));
        let url = format!("http://127.0.0.1:{port}");
        let status = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(2))
            .build()
            .expect("client");
        poll_until(
            "chromedriver answers its status",
            || async {
                status
                    .get(format!("{url}/status"))
                    .send()
                    .await
                    .is_ok_and(|response| response.status().is_success())
            },
            |ready| *ready,
        )
        .await;

        let profile = dir.path().join("profile");
        let mut args: Vec<String> = [
            "--headless=new",
            // Root in a container has no user namespace for the sandbox.
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            // A closed network: nothing may try to phone home, or connections stall.
            "--disable-quic",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--window-size=1280,900",
        ]
        .map(str::to_owned)
        .to_vec();
        args.push(format!("--user-data-dir={}", profile.display()));
        args.extend(extra.iter().cloned());
        let capabilities = json!({
            "browserName": "chrome",
            "acceptInsecureCerts": true,
            // An alert stays open for the test to find instead of being dismissed for it.
            "unhandledPromptBehavior": "ignore",
            "goog:chromeOptions": {"binary": chromium, "args": args},
        });
        let capabilities = capabilities
            .as_object()
            .cloned()
            .expect("capabilities are a JSON object");
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&url)
            .await
            .unwrap_or_else(|error| {
                let log = std::fs::read_to_string(dir.path().join("chromedriver.log"))
                    .unwrap_or_default();
                panic!("no Chromium session: {error}\nchromedriver log:\n{log}")
            });
        Browser {
            client,
            driver: guard.0.take().expect("the driver"),
            dir,
            test: test.to_owned(),
        }
    }

    /// Runs a test body; if it panics, saves a screenshot of every open page into a kept temp
    /// dir (the path is printed), then fails as the body did.
    pub async fn run<T>(&self, body: impl Future<Output = T>) -> T {
        match std::panic::AssertUnwindSafe(body).catch_unwind().await {
            Ok(value) => value,
            Err(panic) => {
                self.save_screenshots().await;
                std::panic::resume_unwind(panic)
            }
        }
    }

    async fn save_screenshots(&self) {
        let kept = match tempfile::Builder::new()
            .prefix(&format!("console-failure-{}-", self.test))
            .tempdir()
        {
            Ok(dir) => dir.keep(),
            Err(error) => {
                eprintln!("no screenshot: {error}");
                return;
            }
        };
        let windows = self.client.windows().await.unwrap_or_default();
        for (index, window) in windows.into_iter().enumerate() {
            if self.client.switch_to_window(window).await.is_err() {
                continue;
            }
            let url = self
                .client
                .current_url()
                .await
                .map(|url| url.to_string())
                .unwrap_or_default();
            match self.client.screenshot().await {
                Ok(png) => {
                    let path = kept.join(format!("page-{index}.png"));
                    if std::fs::write(&path, png).is_ok() {
                        eprintln!("screenshot of {url}: {}", path.display());
                    }
                }
                Err(error) => eprintln!("no screenshot of {url}: {error}"),
            }
        }
        let _ = std::fs::copy(
            self.dir.path().join("chromedriver.log"),
            kept.join("chromedriver.log"),
        );
    }

    /// Ends the session and the driver, and checks that no browser process is left.
    pub async fn close(mut self) {
        let pid = self.driver.id();
        let _ = self.client.clone().close().await;
        kill_group(&mut self.driver);
        poll_until(
            "every chromedriver and Chromium process of this test has exited",
            || std::future::ready(group_alive(pid)),
            |alive| !alive,
        )
        .await;
    }

    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|error| panic!("open {url}: {error}"));
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and reads its result.
    pub async fn js<T: DeserializeOwned>(&self, script: &str, args: Vec<Value>) -> T {
        let value = self
            .client
            .execute(script, args)
            .await
            .unwrap_or_else(|error| panic!("script failed: {error}\n{script}"));
        serde_json::from_value(value.clone())
            .unwrap_or_else(|error| panic!("script result {value} is not as expected: {error}"))
    }

    /// Polls `script` in the page until `done` holds for its result (ten seconds at most).
    pub async fn wait_js<T, F>(&self, what: &str, script: &str, done: F) -> T
    where
        T: DeserializeOwned + std::fmt::Debug,
        F: Fn(&T) -> bool,
    {
        poll_until_with(
            what,
            Patience {
                every: Duration::from_millis(50),
                within: Duration::from_secs(10),
            },
            || async {
                match self.client.execute(script, vec![]).await {
                    Ok(value) => serde_json::from_value::<T>(value).ok(),
                    Err(_) => None,
                }
            },
            |value| value.as_ref().is_some_and(&done),
        )
        .await
        .expect("poll_until returns only a value that satisfied the check")
    }

    /// Waits until `selector` matches an element, then clicks it.
    pub async fn click(&self, selector: &str) {
        self.wait_for(selector).await;
        self.client
            .find(Locator::Css(selector))
            .await
            .unwrap_or_else(|error| panic!("find {selector}: {error}"))
            .click()
            .await
            .unwrap_or_else(|error| panic!("click {selector}: {error}"));
    }

    /// Replaces the value of the input matched by `selector` with `text`, as typed.
    pub async fn fill(&self, selector: &str, text: &str) {
        self.wait_for(selector).await;
        let field = self
            .client
            .find(Locator::Css(selector))
            .await
            .unwrap_or_else(|error| panic!("find {selector}: {error}"));
        field.clear().await.expect("clear the field");
        field
            .send_keys(text)
            .await
            .unwrap_or_else(|error| panic!("type into {selector}: {error}"));
    }

    /// Waits until `selector` matches an element.
    pub async fn wait_for(&self, selector: &str) {
        let script = format!(
            "return document.querySelector({}) !== null;",
            Value::from(selector)
        );
        self.wait_js::<bool, _>(&format!("{selector} appears"), &script, |found| *found)
            .await;
    }

    /// The text of the first element matching `selector` ("" when there is none).
    pub async fn text(&self, selector: &str) -> String {
        self.js(
            "const e = document.querySelector(arguments[0]); return e ? e.textContent : '';",
            vec![Value::from(selector)],
        )
        .await
    }

    /// Waits until the text of `selector` satisfies `done`, and returns it.
    pub async fn wait_text(&self, selector: &str, done: impl Fn(&str) -> bool) -> String {
        let script = format!(
            "const e = document.querySelector({}); return e ? e.textContent : '';",
            Value::from(selector)
        );
        self.wait_js::<String, _>(&format!("the text of {selector}"), &script, |text| {
            done(text)
        })
        .await
    }

    /// The cells' text of each body row of the table with id `table`.
    pub async fn table(&self, table: &str) -> Vec<Vec<String>> {
        self.js(&table_script(table), vec![]).await
    }

    /// Waits until the body rows of the table with id `table` satisfy `done` (ten seconds at
    /// most); returns their cells' text.
    pub async fn wait_table(
        &self,
        what: &str,
        table: &str,
        done: impl Fn(&Vec<Vec<String>>) -> bool,
    ) -> Vec<Vec<String>> {
        self.wait_js(what, &table_script(table), done).await
    }

    /// Sets the viewport (the page's `innerWidth`×`innerHeight`) to exactly `width`×`height`.
    pub async fn set_viewport(&self, width: u32, height: u32) {
        self.client
            .set_window_size(width, height)
            .await
            .expect("resize the window");
        let (inner_width, inner_height): (u32, u32) = self
            .js("return [window.innerWidth, window.innerHeight];", vec![])
            .await;
        // The window's frame, if headless draws one, is added once so the page gets the size.
        if (inner_width, inner_height) != (width, height) {
            let outer = |wanted: u32, got: u32| (2 * wanted).saturating_sub(got).max(wanted);
            self.client
                .set_window_size(outer(width, inner_width), outer(height, inner_height))
                .await
                .expect("resize the window");
        }
        let script =
            format!("return window.innerWidth === {width} && window.innerHeight === {height};");
        self.wait_js::<bool, _>(&format!("a {width}×{height} viewport"), &script, |ok| *ok)
            .await;
    }

    /// Opens a second tab and switches to it; returns (first, second) window handles.
    pub async fn open_tab(&self) -> (fantoccini::wd::WindowHandle, fantoccini::wd::WindowHandle) {
        let first = self.client.window().await.expect("current window");
        let second = self
            .client
            .new_window(true)
            .await
            .expect("a new tab")
            .handle;
        self.client
            .switch_to_window(second.clone())
            .await
            .expect("switch to the new tab");
        (first, second)
    }

    pub async fn switch_to(&self, window: &fantoccini::wd::WindowHandle) {
        self.client
            .switch_to_window(window.clone())
            .await
            .expect("switch tabs");
    }

    /// Whether an alert, confirm or prompt dialog is open.
    pub async fn dialog_open(&self) -> bool {
        match self.client.get_alert_text().await {
            Ok(_) => true,
            Err(error) if error.is_no_such_alert() => false,
            Err(error) => panic!("ask for a dialog: {error}"),
        }
    }
}

/// Kills the driver's process group if the browser was never handed out (start failed).
struct DriverGuard(Option<Child>);

impl Drop for DriverGuard {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            kill_group(child);
        }
    }
}

impl Drop for Browser {
    /// A test that failed before [`Browser::close`] still leaves no process behind.
    fn drop(&mut self) {
        if let Ok(None) = self.driver.try_wait() {
            kill_group(&mut self.driver);
        }
    }
}

/// A static HTTPS origin: `openssl s_server -WWW` serving the files of a temp dir with a
/// self-signed certificate for `name`, in its own process group. The browser reaches it by name
/// through `--host-resolver-rules` ([`TlsOrigin::resolver_rule`]) and accepts its certificate.
pub struct TlsOrigin {
    pub port: u16,
    name: String,
    server: Child,
    dir: TempDir,
}

impl TlsOrigin {
    pub async fn start(name: &str) -> TlsOrigin {
        let openssl = program("openssl", &["/usr/bin/openssl"]).unwrap_or_else(|| {
            panic!("the CORS browser test serves an https origin with `openssl s_server`: install the Debian package `openssl`")
        });
        let dir = tempfile::tempdir().expect("temp dir");
        let made = Command::new(&openssl)
            .args([
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
            ])
            .args([
                "-nodes", "-keyout", "key.pem", "-out", "cert.pem", "-days", "1",
            ])
            .args([
                "-subj",
                &format!("/CN={name}"),
                "-addext",
                &format!("subjectAltName=DNS:{name}"),
            ])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .output()
            .expect("run openssl req");
        assert!(
            made.status.success(),
            "openssl req: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        let port = free_port();
        let server = Command::new(&openssl)
            .args([
                "s_server", "-quiet", "-WWW", "-cert", "cert.pem", "-key", "key.pem",
            ])
            .arg("-accept")
            .arg(format!("127.0.0.1:{port}"))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start openssl s_server");
        let origin = TlsOrigin {
            port,
            name: name.to_owned(),
            server,
            dir,
        };
        poll_until(
            "openssl s_server accepts connections",
            || std::future::ready(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()),
            |ready| *ready,
        )
        .await;
        origin
    }

    /// Serves `content` at `https://NAME/FILE`.
    pub fn put(&self, file: &str, content: &str) {
        std::fs::write(self.dir.path().join(file), content).expect("write a served file");
    }

    /// The Chromium argument that sends connections for the name to this server.
    pub fn resolver_rule(&self) -> String {
        format!(
            "--host-resolver-rules=MAP {} 127.0.0.1:{}",
            self.name, self.port
        )
    }
}

impl Drop for TlsOrigin {
    fn drop(&mut self) {
        kill_group(&mut self.server);
    }
}

/// A script answering the cells' text of each body row of the table with id `table`.
fn table_script(table: &str) -> String {
    format!(
        "const t = document.getElementById({});
         return t ? Array.from(t.tBodies[0].rows, r => Array.from(r.cells, c => c.textContent)) : [];",
        Value::from(table)
    )
}
