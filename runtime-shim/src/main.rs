//! tessera-runtime: runc-compatible argv in, hardened bundle, exec of the real runc.

use tessera_runtime::app::{self, Outcome};

fn main() {
    match app::run(std::env::args_os().skip(1).collect()) {
        Outcome::Exit(code) => std::process::exit(code),
        Outcome::Exec(plan) => {
            let err = app::exec_plan(&plan);
            eprintln!("tessera-runtime: {err}");
            std::process::exit(1);
        }
    }
}
