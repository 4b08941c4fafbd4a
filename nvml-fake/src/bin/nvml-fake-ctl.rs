//! nvml-fake-ctl: make and change the fake NVML's hardware (the state file named by
//! `TESSERA_FAKE_NVML_STATE`, or `--state PATH` first).
//!
//! ```text
//! nvml-fake-ctl init [--board=pcie|hgx-nvswitch|pcie-pairs] MODEL[:mig] ...
//!                                          fresh GPUs (a100-40gb, a100-80gb, h100-80gb, h200-141gb)
//! nvml-fake-ctl minors PATH                write the driver's mig-minors table for these GPUs
//! nvml-fake-ctl lose GPU | restore GPU     fall off the bus / come back
//! nvml-fake-ctl xid GPU XID [GI]           queue an XID event (GI: the contained instance)
//! nvml-fake-ctl ecc GPU                    queue a double-bit ECC event
//! nvml-fake-ctl fail CALL CODE [GPU [TIMES]]   CALL answers nvmlReturn_t CODE ("*": every call)
//! nvml-fake-ctl hang CALL MS [GPU [TIMES]]     CALL first sleeps MS milliseconds
//! nvml-fake-ctl clear-faults [GPU]
//! nvml-fake-ctl process GPU PID BYTES [GI CI] | remove-process GPU PID | clear-processes GPU
//! nvml-fake-ctl rows GPU pending|failed|ok
//! nvml-fake-ctl show
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use nvidia_ml::state::{self, Event, Fault, Process, State};

fn usage() -> ExitCode {
    eprintln!(
        "usage: nvml-fake-ctl [--state PATH] init [--board=B] MODEL[:mig]... | minors PATH | lose GPU | restore GPU | xid GPU XID [GI] | ecc GPU | fail CALL CODE [GPU [TIMES]] | hang CALL MS [GPU [TIMES]] | clear-faults [GPU] | process GPU PID BYTES [GI CI] | remove-process GPU PID | clear-processes GPU | rows GPU pending|failed|ok | show"
    );
    ExitCode::from(64)
}

fn num<T: std::str::FromStr>(s: Option<&String>, what: &str) -> Result<T, String> {
    s.ok_or_else(|| format!("missing {what}"))?
        .parse()
        .map_err(|_| format!("bad {what}"))
}

fn opt<T: std::str::FromStr>(s: Option<&String>, what: &str) -> Result<Option<T>, String> {
    s.map(|v| v.parse().map_err(|_| format!("bad {what}")))
        .transpose()
}

fn run(mut args: Vec<String>) -> Result<(), String> {
    let path = if args.first().map(String::as_str) == Some("--state") {
        let p = args.get(1).cloned().ok_or("--state needs a path")?;
        args.drain(..2);
        PathBuf::from(p)
    } else {
        state::path_from_env().map_err(|e| e.to_string())?
    };
    let Some(cmd) = args.first().cloned() else {
        return Err("no command".into());
    };
    let rest = &args[1..];
    if cmd == "init" {
        return init(&path, rest);
    }
    let mut locked = state::lock(&path).map_err(|e| e.to_string())?;
    let st = &mut locked.state;
    match cmd.as_str() {
        "show" => {
            let text = serde_json::to_string_pretty(st).map_err(|e| e.to_string())?;
            println!("{text}");
            return Ok(());
        }
        "minors" => {
            let out = rest.first().ok_or("minors needs a path")?;
            return std::fs::write(out, minors_text(st.gpus.len() as u32))
                .map_err(|e| format!("{out}: {e}"));
        }
        _ => change(&cmd, rest, st)?,
    }
    locked.save().map_err(|e| e.to_string())
}

/// `init [--board=B] MODEL[:mig]...`: fresh GPUs.
fn init(path: &std::path::Path, rest: &[String]) -> Result<(), String> {
    let mut gpus = Vec::new();
    let mut board = state::Board::default();
    for spec in rest {
        if let Some(name) = spec.strip_prefix("--board=") {
            board = state::Board::parse(name).ok_or_else(|| format!("unknown board {name:?}"))?;
            continue;
        }
        let (model, mig) = match spec.strip_suffix(":mig") {
            Some(m) => (m, true),
            None => (spec.as_str(), false),
        };
        let model =
            nvidia_ml::parse_model(model).ok_or_else(|| format!("unknown model {model:?}"))?;
        gpus.push((model, mig));
    }
    let mut st = State::new(&gpus);
    st.board = board;
    state::write_state(path, &st).map_err(|e| e.to_string())
}

/// The driver's mig-minors table for `gpus` GPUs.
fn minors_text(gpus: u32) -> String {
    let mut text = String::from("config 1\nmonitor 2\n");
    for g in 0..gpus {
        for gi in 0..15u32 {
            let m = 3 + g * 135 + gi * 9;
            text.push_str(&format!("gpu{g}/gi{gi}/access {m}\n"));
            for ci in 0..8u32 {
                text.push_str(&format!("gpu{g}/gi{gi}/ci{ci}/access {}\n", m + 1 + ci));
            }
        }
    }
    text
}

/// The GPU index argument at `i`, checked against the GPUs there are.
fn gpu_arg(rest: &[String], i: usize, st: &State) -> Result<usize, String> {
    let g: usize = num(rest.get(i), "GPU index")?;
    if g >= st.gpus.len() {
        return Err(format!("no GPU {g}"));
    }
    Ok(g)
}

/// A command that changes the hardware's state.
fn change(cmd: &str, rest: &[String], st: &mut State) -> Result<(), String> {
    match cmd {
        "lose" | "restore" => {
            let g = gpu_arg(rest, 0, st)?;
            st.gpus[g].lost = cmd == "lose";
        }
        "xid" => {
            let g = gpu_arg(rest, 0, st)?;
            st.events.push(Event {
                gpu: g as u32,
                xid: Some(num(rest.get(1), "XID")?),
                gi: opt(rest.get(2), "GI")?,
            });
        }
        "ecc" => {
            let g = gpu_arg(rest, 0, st)?;
            st.events.push(Event {
                gpu: g as u32,
                xid: None,
                gi: None,
            });
        }
        "fail" | "hang" => st.faults.push(fault(cmd, rest)?),
        "clear-faults" => match opt::<u32>(rest.first(), "GPU")? {
            Some(g) => st.faults.retain(|f| f.gpu != Some(g)),
            None => st.faults.clear(),
        },
        "process" | "remove-process" | "clear-processes" => processes(cmd, rest, st)?,
        "rows" => {
            let g = gpu_arg(rest, 0, st)?;
            let how = rest.get(1).map(String::as_str);
            st.gpus[g].rows_pending = how == Some("pending");
            st.gpus[g].rows_failed = how == Some("failed");
        }
        other => return Err(format!("unknown command {other:?}")),
    }
    Ok(())
}

/// `fail CALL CODE [GPU [TIMES]]` or `hang CALL MS [GPU [TIMES]]`.
fn fault(cmd: &str, rest: &[String]) -> Result<Fault, String> {
    let call = rest.first().ok_or("missing CALL")?.clone();
    let v: u64 = num(rest.get(1), "CODE or MS")?;
    Ok(Fault {
        call,
        gpu: opt(rest.get(2), "GPU")?,
        code: if cmd == "fail" {
            u32::try_from(v).map_err(|_| "bad CODE")?
        } else {
            0
        },
        hang_ms: if cmd == "hang" { v } else { 0 },
        times: opt(rest.get(3), "TIMES")?,
    })
}

/// `process GPU PID BYTES [GI CI]`, `remove-process GPU PID`, `clear-processes GPU`.
fn processes(cmd: &str, rest: &[String], st: &mut State) -> Result<(), String> {
    let g = gpu_arg(rest, 0, st)?;
    let procs = &mut st.gpus[g].processes;
    match cmd {
        "process" => procs.push(Process {
            pid: num(rest.get(1), "PID")?,
            used_memory: num(rest.get(2), "BYTES")?,
            gi: opt(rest.get(3), "GI")?,
            ci: opt(rest.get(4), "CI")?,
        }),
        "remove-process" => {
            let pid: u32 = num(rest.get(1), "PID")?;
            let before = procs.len();
            procs.retain(|p| p.pid != pid);
            if procs.len() == before {
                return Err(format!("pid {pid} is not running on GPU {g}"));
            }
        }
        _ => procs.clear(),
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.is_empty() {
        return usage();
    }
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvml-fake-ctl: {e}");
            ExitCode::from(1)
        }
    }
}
