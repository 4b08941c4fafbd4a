//! tessera-runtime: runc-compatible argv in, hardened bundle, exec of the real runc.

use tessera_runtime::app::{self, Outcome};

fn main() {
    let mut args = std::env::args_os();
    let argv0 = args.next().map(std::path::PathBuf::from);
    match app::run_as(argv0, args.collect()) {
        Outcome::Exit(code) => std::process::exit(code),
        Outcome::Exec(plan) => {
            let err = app::exec_plan(&plan);
            eprintln!("tessera-runtime: {err}");
            std::process::exit(1);
        }
    }
}
