//! The command-line path's clean-up: on its time limit and on SIGTERM.
//!
//! A separate test binary (so a separate process) because it signals itself. Needs root and
//! `/dev/net/tun` (this machine kind and CI have both); fails without them.

use std::time::Duration;

use kvferry_wanem::{PathProfile, check_support};

fn listed_namespaces() -> String {
    let out = std::process::Command::new("ip").args(["netns", "list"]).output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn cli_run_cleans_up_on_sigterm_and_on_timeout() {
    if let Err(e) = check_support() {
        panic!("needs root and /dev/net/tun (this machine kind and CI have both): {e}");
    }
    use kvferry_wanem::cli::{RunOptions, run};
    // Time limit: the command outlives the run.
    let mut opts = RunOptions::new(PathProfile::preset("clean").unwrap(), Duration::from_millis(300));
    opts.command_a = Some(vec!["sleep".into(), "30".into()]);
    let out = run(&opts).unwrap();
    assert!(out.timed_out && out.status_a.is_none());
    assert!(out.elapsed < Duration::from_secs(5));
    // A signal: the handler turns it into an orderly shutdown.
    let pid = std::process::id();
    let before: Vec<String> = kvferry_wanem::netns::list_ours();
    let mut opts = RunOptions::new(PathProfile::preset("clean").unwrap(), Duration::from_secs(20));
    opts.command_a = Some(vec!["sleep".into(), "30".into()]);
    let runner = std::thread::spawn(move || run(&opts));
    // Wait until the run's namespaces exist (the handler is installed before they are made).
    let t0 = std::time::Instant::now();
    let mine = loop {
        let now: Vec<String> = kvferry_wanem::netns::list_ours()
            .into_iter()
            .filter(|n| n.starts_with(&format!("kvf-{pid}-")) && !before.contains(n))
            .collect();
        if now.len() >= 2 || t0.elapsed() > Duration::from_secs(10) {
            break now;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(mine.len() >= 2, "namespaces never appeared");
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: signalling our own process; cli::run installed a handler for SIGTERM.
    unsafe {
        libc::kill(pid as i32, libc::SIGTERM);
    }
    let out = runner.join().unwrap().unwrap();
    assert!(out.interrupted);
    assert!(out.elapsed < Duration::from_secs(10));
    let listed = listed_namespaces();
    for n in &mine {
        assert!(!listed.contains(n.as_str()), "{n} still present: {listed}");
    }
}
