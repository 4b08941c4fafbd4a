//! tessera-runtime: runc-compatible argv in, hardened bundle, exec of the real runc.
//! `tessera-runtime serve` runs the runtime helper (see `helper.rs`).

use tessera_runtime::app::{self, Outcome};
use tessera_runtime::helper::{self, HelperError};

fn main() {
    let mut args = std::env::args_os();
    let argv0 = args.next().map(std::path::PathBuf::from);
    let args: Vec<_> = args.collect();
    if args.first().is_some_and(|a| a == "serve") {
        if args.len() > 1 {
            eprintln!(
                "tessera-runtime serve: takes no arguments (its config says where it listens)"
            );
            std::process::exit(app::EXIT_CONFIG);
        }
        match helper::serve(argv0.as_deref()) {
            Ok(()) => std::process::exit(0),
            Err(e) => {
                eprintln!("tessera-runtime serve: {e}");
                let code = match e {
                    HelperError::Config(_) | HelperError::NoSocket(_) => app::EXIT_CONFIG,
                    _ => 1,
                };
                std::process::exit(code);
            }
        }
    }
    match app::run_as(argv0, args) {
        Outcome::Exit(code) => std::process::exit(code),
        Outcome::Exec(plan) => {
            let err = app::exec_plan(&plan);
            eprintln!("tessera-runtime: {err}");
            std::process::exit(1);
        }
    }
}
