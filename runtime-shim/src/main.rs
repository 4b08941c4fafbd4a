//! tessera-runtime: runc-compatible argv in, hardened bundle, the real runc run on it
//! (exec'd, or started early and waited for: `early.rs`).
//!
//! The entry point is C's `main`, not Rust's: the runtime is exec'd for every container
//! start and delete, and Rust's own start-up (reading /proc/self/maps to find the main
//! thread's stack, mapping an alternate signal stack for its stack-overflow message)
//! was 0.08 ms of each. What of it matters here is done in [`start_up`]: the standard
//! fds are made sure to be open, and SIGPIPE is ignored (a daemon that goes away is an
//! error to report, not a silent death). A stack overflow is still a crash (SIGSEGV on
//! the kernel's guard gap), only without Rust's message.
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
use tessera_runtime::app::{self, Outcome};

#[cfg(not(test))]
#[unsafe(no_mangle)]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    start_up();
    // A panic has printed its message (the default hook); exit as Rust's own `main`
    // would after one, rather than abort at this C boundary.
    std::panic::catch_unwind(run).unwrap_or(101)
}

#[cfg(not(test))]
fn run() -> libc::c_int {
    let mut args = std::env::args_os();
    let argv0 = args.next().map(std::path::PathBuf::from);
    match app::run_as(argv0, args.collect()) {
        Outcome::Exit(code) => std::process::exit(code),
        Outcome::Mirror(status) => tessera_runtime::early::exit_like(status),
        Outcome::Exec(plan) => {
            let err = app::exec_plan(&plan);
            eprintln!("tessera-runtime: {err}");
            std::process::exit(1);
        }
    }
}

/// What Rust's start-up does that the runtime relies on.
#[cfg(not(test))]
fn start_up() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    // fds 0-2 closed by the caller would be handed to the next files opened (the
    // bundle's config.json as someone's stderr): hold them with /dev/null, in order.
    for fd in 0..=2 {
        if nix::fcntl::fcntl(fd, nix::fcntl::FcntlArg::F_GETFD) == Err(nix::errno::Errno::EBADF) {
            match std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
            {
                Ok(f) => {
                    // Kept open for the life of the process and across the exec of
                    // runc (std opens files close-on-exec).
                    let held = std::os::fd::IntoRawFd::into_raw_fd(f);
                    let inherit = nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty());
                    if nix::fcntl::fcntl(held, inherit).is_err() {
                        std::process::exit(1);
                    }
                }
                Err(_) => std::process::exit(1),
            }
        }
    }
    // SAFETY: ignoring a signal installs no handler code; nothing else in the process
    // has set or relies on a SIGPIPE handler. std::process::Command restores the
    // default before it execs runc.
    let _ = unsafe { signal(Signal::SIGPIPE, SigHandler::SigIgn) };
}
