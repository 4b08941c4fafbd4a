//! runtime-bench: time `tessera-runtime run` against plain `runc run` of the same busybox
//! bundle (`/bin/true`), pairwise and alternating, and print medians and ratios.
//!
//! Three variants per iteration, in rotating order:
//! - `runc`: runc on the tenant's spec as given;
//! - `runc+hardened`: runc on the spec tessera-runtime produces (what runc itself costs
//!   with seccomp, masks and device rules);
//! - `tessera`: tessera-runtime on the tenant's spec (hardening + exec of runc).
//!
//! Needs root, runc and busybox. Usage:
//!   runtime-bench [--iterations N] [--runtime PATH] [--runc PATH]
//!                 [--daemon-socket PATH --token TOKEN]   (lease path against a real tesserad)

use anyhow::{Context, Result, bail};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

struct Args {
    iterations: usize,
    runtime: PathBuf,
    runc: PathBuf,
    daemon_socket: Option<PathBuf>,
    token: Option<String>,
}

fn parse_args() -> Result<Args> {
    let exe = std::env::current_exe().context("current_exe")?;
    let mut a = Args {
        iterations: 50,
        runtime: exe.with_file_name("tessera-runtime"),
        runc: PathBuf::from("/usr/sbin/runc"),
        daemon_socket: None,
        token: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--iterations" | "-n" => a.iterations = value()?.parse().context("--iterations")?,
            "--runtime" => a.runtime = value()?.into(),
            "--runc" => a.runc = value()?.into(),
            "--daemon-socket" => a.daemon_socket = Some(value()?.into()),
            "--token" => a.token = Some(value()?),
            "-h" | "--help" => {
                println!(
                    "runtime-bench [--iterations N] [--runtime PATH] [--runc PATH] [--daemon-socket PATH --token TOKEN]"
                );
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    if a.iterations == 0 {
        bail!("--iterations must be positive");
    }
    Ok(a)
}

fn rootfs(dir: &Path) -> Result<PathBuf> {
    let rootfs = dir.join("rootfs");
    for d in ["bin", "proc", "sys", "dev", "tmp"] {
        std::fs::create_dir_all(rootfs.join(d)).with_context(|| format!("mkdir {d}"))?;
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).context("copy /bin/busybox")?;
    std::os::unix::fs::symlink("busybox", rootfs.join("bin/true")).context("symlink true")?;
    Ok(rootfs)
}

fn spec(rootfs: &Path, token: Option<&str>) -> serde_json::Value {
    let caps = json!([
        "CAP_CHOWN",
        "CAP_DAC_OVERRIDE",
        "CAP_FSETID",
        "CAP_FOWNER",
        "CAP_MKNOD",
        "CAP_NET_RAW",
        "CAP_SETGID",
        "CAP_SETUID",
        "CAP_SETFCAP",
        "CAP_SETPCAP",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_CHROOT",
        "CAP_KILL",
        "CAP_AUDIT_WRITE"
    ]);
    let mut s = json!({
        "ociVersion": "1.0.2-dev",
        "process": {"user": {"uid": 0, "gid": 0}, "args": ["/bin/true"], "env": ["PATH=/bin"],
                    "cwd": "/", "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
                    "noNewPrivileges": true},
        "root": {"path": rootfs},
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}
        ],
        "linux": {"resources": {"devices": [{"allow": false, "access": "rwm"}]},
                  "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]}
    });
    if let Some(t) = token {
        s["annotations"] = json!({"tessera.io/lease-token": t});
    }
    s
}

fn time_run(
    program: &Path,
    root: &Path,
    bundle: &Path,
    id: &str,
    env: &[(&str, &Path)],
) -> Result<Duration> {
    let start = Instant::now();
    let mut cmd = Command::new(program);
    cmd.arg("--root")
        .arg(root)
        .args(["run", "--bundle"])
        .arg(bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", program.display()))?;
    let took = start.elapsed();
    if !out.status.success() {
        bail!(
            "{} run failed: {}",
            program.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(took)
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort();
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn main() -> Result<()> {
    let args = parse_args()?;
    if !nix::unistd::geteuid().is_root() {
        bail!("runtime-bench needs root (runc run)");
    }
    let dir = tempfile_dir()?;
    let rootfs = rootfs(&dir)?;
    let root = dir.join("runc-root");
    let config = dir.join("runtime.toml");
    let socket = args
        .daemon_socket
        .clone()
        .unwrap_or_else(|| dir.join("no-daemon.sock"));
    std::fs::write(
        &config,
        format!(
            "runc_path = {:?}\ndaemon_socket = {:?}\nnvidia_proc_root = {:?}\n[policy]\napparmor = \"if-available\"\n",
            args.runc,
            socket,
            dir.join("no-nvidia")
        ),
    )
    .context("writing runtime.toml")?;
    let original = serde_json::to_vec(&spec(&rootfs, args.token.as_deref()))?;
    let plain = dir.join("plain");
    let tess = dir.join("tessera");
    let hard = dir.join("hardened");
    for b in [&plain, &tess, &hard] {
        std::fs::create_dir_all(b)?;
        std::fs::write(b.join("config.json"), &original)?;
    }
    // The hardened spec, as tessera-runtime writes it (check prints it).
    let out = Command::new(&args.runtime)
        .env("TESSERA_RUNTIME_CONFIG", &config)
        .args(["check", "--json", "--bundle"])
        .arg(&tess)
        .output()
        .with_context(|| format!("running {}", args.runtime.display()))?;
    let checked: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("check --json output")?;
    if checked["admitted"] != true {
        bail!("the bench spec was refused: {}", checked["reasons"]);
    }
    std::fs::write(
        hard.join("config.json"),
        serde_json::to_vec(&checked["spec"])?,
    )?;

    let env: [(&str, &Path); 1] = [("TESSERA_RUNTIME_CONFIG", &config)];
    let (mut t_plain, mut t_hard, mut t_tess) = (Vec::new(), Vec::new(), Vec::new());
    // Warm-up (page cache, binaries).
    time_run(&args.runc, &root, &plain, "warm-0", &[])?;
    std::fs::write(tess.join("config.json"), &original)?;
    time_run(&args.runtime, &root, &tess, "warm-1", &env)?;
    for i in 0..args.iterations {
        for k in 0..3 {
            match (i + k) % 3 {
                0 => t_plain.push(time_run(&args.runc, &root, &plain, &format!("p{i}"), &[])?),
                1 => t_hard.push(time_run(&args.runc, &root, &hard, &format!("h{i}"), &[])?),
                _ => {
                    // Each run starts from the tenant's spec (not timed).
                    std::fs::write(tess.join("config.json"), &original)?;
                    t_tess.push(time_run(
                        &args.runtime,
                        &root,
                        &tess,
                        &format!("t{i}"),
                        &env,
                    )?);
                }
            }
        }
    }
    let (mp, mh, mt) = (
        median(&mut t_plain),
        median(&mut t_hard),
        median(&mut t_tess),
    );
    println!(
        "iterations: {} (alternating, rotating order)",
        args.iterations
    );
    println!("runc run (tenant spec)          median {:8.2} ms", ms(mp));
    println!("runc run (hardened spec)        median {:8.2} ms", ms(mh));
    println!("tessera-runtime run             median {:8.2} ms", ms(mt));
    println!(
        "ratio tessera / runc            {:.3}",
        mt.as_secs_f64() / mp.as_secs_f64()
    );
    println!(
        "ratio tessera / runc(hardened)  {:.3}",
        mt.as_secs_f64() / mh.as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("tessera-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).with_context(|| format!("mkdir {}", d.display()))?;
    Ok(d)
}
