//! Build script: with feature `cuda`, compiles every `.cu` below `kernels/` with nvcc into
//! `libcandleflash.a` (in OUT_DIR) and links it, plus `cudart` (dynamic) and `stdc++`.
//! Without `cuda` it does nothing and needs nothing.
//!
//! Environment (all optional):
//!   NVCC                         path of nvcc; else $CUDA_ROOT/bin/nvcc, $CUDA_PATH/bin/nvcc,
//!                                $CUDA_HOME/bin/nvcc, then `nvcc` from PATH.
//!   CUDA_ROOT / CUDA_PATH / CUDA_HOME
//!                                toolkit root; `<root>/lib64` (or lib) is added to the link
//!                                search path for cudart. Default: the folder above nvcc's bin/.
//!   CANDLE_FLASH_CUDA_ARCHS      targets, space- or comma-separated. Each item is either
//!                                `80` / `sm_80` / `90a`  -> SASS   (arch=compute_X,code=sm_X),
//!                                `compute_90`            -> PTX    (arch=compute_90,code=compute_90),
//!                                or any nvcc flag starting with `-` (e.g. `-gencode=...`), verbatim.
//!                                Default: `80 90a compute_90`, i.e.
//!                                -gencode=arch=compute_80,code=sm_80
//!                                -gencode=arch=compute_90a,code=sm_90a
//!                                -gencode=arch=compute_90,code=compute_90
//!   CANDLE_FLASH_PTXAS_VERBOSE   if set (and not "0"), adds `-Xptxas -v`; the register/spill
//!                                report is shown as cargo warnings.
//!   CANDLE_FLASH_NVCC_FLAGS      extra nvcc flags, space-separated (e.g. `-lineinfo`).
//!   CANDLE_FLASH_NVCC_JOBS       max nvcc processes at once (default: one per .cu file).
//!   NVCC_CCBIN                   host compiler for nvcc (`-ccbin`).
//!
//! A kernel object is reused when its compile command is unchanged and nothing in its
//! nvcc-generated dependency file (`-MD`) is newer than it, so editing one .cu recompiles
//! only that file; editing a header recompiles the files that include it. Objects are
//! cached in `target/<profile>/build/candle-flash-nvcc-cache/`, shared by `cargo build`,
//! `cargo test` and `cargo clippy` (see `object_dir`).

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

const DEFAULT_ARCHS: &str = "80 90a compute_90";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    build_cuda();
}

fn env_nonempty(key: &str) -> Option<String> {
    println!("cargo:rerun-if-env-changed={key}");
    env::var(key).ok().filter(|v| !v.trim().is_empty())
}

fn build_cuda() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let kernels_dir = manifest_dir.join("kernels");

    // ---- rerun triggers: the kernels dir and every file below it
    println!("cargo:rerun-if-changed={}", kernels_dir.display());
    let mut all_files = Vec::new();
    walk(&kernels_dir, &mut all_files);
    for f in &all_files {
        println!("cargo:rerun-if-changed={}", f.display());
    }

    // ---- toolkit
    let roots: Vec<PathBuf> =
        ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"].iter().filter_map(|k| env_nonempty(k)).map(PathBuf::from).collect();
    let nvcc = find_nvcc(&roots);
    let ccbin = env_nonempty("NVCC_CCBIN");

    // ---- sources: every .cu below kernels/ (common/, sm80/, sm90/, simt/, dispatch.cu), sorted
    let mut sources: Vec<PathBuf> =
        all_files.iter().filter(|p| p.extension().is_some_and(|e| e == "cu")).cloned().collect();
    sources.sort();
    if sources.is_empty() {
        println!(
            "cargo:warning=candle-flash: feature `cuda` is on but {} has no .cu files; \
             no kernels were built",
            kernels_dir.display()
        );
        return;
    }

    // ---- flags
    let archs = env_nonempty("CANDLE_FLASH_CUDA_ARCHS").unwrap_or_else(|| DEFAULT_ARCHS.into());
    let gencodes = parse_archs(&archs);
    let ptxas_verbose = env_nonempty("CANDLE_FLASH_PTXAS_VERBOSE").is_some_and(|v| v.trim() != "0");
    let extra: Vec<String> = env_nonempty("CANDLE_FLASH_NVCC_FLAGS")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    let jobs = env_nonempty("CANDLE_FLASH_NVCC_JOBS")
        .map(|s| s.trim().parse::<usize>().unwrap_or_else(|_| panic!("CANDLE_FLASH_NVCC_JOBS={s:?} is not a number")))
        .unwrap_or(sources.len())
        .clamp(1, sources.len());

    let mut common: Vec<String> = vec![
        "-O3".into(),
        "-std=c++17".into(),
        "--expt-relaxed-constexpr".into(),
        "-Xcompiler".into(),
        "-fPIC".into(),
        format!("-I{}", kernels_dir.display()),
    ];
    if let Some(cc) = &ccbin {
        common.push("-ccbin".into());
        common.push(cc.clone());
    }
    common.extend(gencodes);
    if ptxas_verbose {
        common.push("-Xptxas".into());
        common.push("-v".into());
    }
    common.extend(extra);

    let obj_dir = object_dir(&out_dir);
    fs::create_dir_all(&obj_dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", obj_dir.display()));

    // ---- compile, one nvcc per file, at most `jobs` at once
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<(usize, CompileResult)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= sources.len() {
                    break;
                }
                let r = compile_one(&nvcc, &common, &sources[i], &obj_dir, &manifest_dir);
                results.lock().unwrap().push((i, r));
            });
        }
    });
    let mut results = results.into_inner().unwrap();
    results.sort_by_key(|(i, _)| *i);

    let mut failed = Vec::new();
    let mut objects = Vec::new();
    for (i, r) in &results {
        let name = sources[*i].strip_prefix(&kernels_dir).unwrap_or(&sources[*i]).display().to_string();
        match r {
            CompileResult::UpToDate(obj) => objects.push(obj.clone()),
            CompileResult::Ok { obj, stderr } => {
                objects.push(obj.clone());
                // surface nvcc/ptxas diagnostics (warnings, ptxas -v report)
                for line in stderr.lines().filter(|l| !l.trim().is_empty()) {
                    println!("cargo:warning={name}: {line}");
                }
            }
            CompileResult::Failed { cmd, stderr } => {
                eprintln!("==================== nvcc failed on {name} ====================");
                eprintln!("command: {cmd}");
                eprintln!("{stderr}");
                failed.push(name);
            }
        }
    }
    if !failed.is_empty() {
        panic!(
            "candle-flash: nvcc failed to compile {} of {} kernel file(s): {} \
             (full nvcc output above)",
            failed.len(),
            sources.len(),
            failed.join(", ")
        );
    }

    // ---- archive
    let lib = out_dir.join("libcandleflash.a");
    let _ = fs::remove_file(&lib);
    let ar = env::var("AR").unwrap_or_else(|_| "ar".into());
    let out = Command::new(&ar)
        .arg("crs")
        .arg(&lib)
        .args(&objects)
        .output()
        .unwrap_or_else(|e| panic!("candle-flash: cannot run `{ar}`: {e}"));
    if !out.status.success() {
        panic!("candle-flash: `{ar} crs {}` failed:\n{}", lib.display(), String::from_utf8_lossy(&out.stderr));
    }

    // ---- link
    println!("cargo:rustc-link-search=native={}", out_dir.display());
    println!("cargo:rustc-link-lib=static=candleflash");
    let mut lib_roots = roots.clone();
    if let Some(root) = nvcc.parent().and_then(|b| b.parent()) {
        lib_roots.push(root.to_path_buf());
    }
    let mut seen = Vec::new();
    for root in &lib_roots {
        for sub in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            let d = root.join(sub);
            if d.is_dir() && !seen.contains(&d) {
                println!("cargo:rustc-link-search=native={}", d.display());
                seen.push(d);
            }
        }
    }
    println!("cargo:rustc-link-lib=dylib=cudart");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

/// Where kernel objects live. Cargo gives this build script a different OUT_DIR per
/// feature set and for `cargo clippy` (a workspace wrapper changes the unit hash), so
/// objects are kept in one cache next to the build dirs,
/// `target/<profile>/build/candle-flash-nvcc-cache/`, shared by all of them (the
/// target dir is locked by cargo, so builds never race on it). Falls back to
/// OUT_DIR/kernels if OUT_DIR does not have cargo's usual `build/<pkg>-<hash>/out` shape.
fn object_dir(out_dir: &Path) -> PathBuf {
    let build_dir = out_dir
        .parent()
        .filter(|_| out_dir.file_name().is_some_and(|n| n == "out"))
        .and_then(Path::parent)
        .filter(|b| b.file_name().is_some_and(|n| n == "build"));
    match build_dir {
        Some(b) => b.join("candle-flash-nvcc-cache"),
        None => out_dir.join("kernels"),
    }
}

/// Turn CANDLE_FLASH_CUDA_ARCHS into nvcc flags.
fn parse_archs(spec: &str) -> Vec<String> {
    let mut flags = Vec::new();
    for tok in spec.split(|c: char| c.is_whitespace() || c == ',') {
        let tok = tok.trim();
        if tok.is_empty() {
            continue;
        }
        if tok.starts_with('-') {
            flags.push(tok.to_string());
        } else if let Some(cc) = tok.strip_prefix("compute_") {
            check_cc(cc, spec);
            flags.push(format!("-gencode=arch=compute_{cc},code=compute_{cc}"));
        } else {
            let cc = tok.strip_prefix("sm_").unwrap_or(tok);
            check_cc(cc, spec);
            flags.push(format!("-gencode=arch=compute_{cc},code=sm_{cc}"));
        }
    }
    if flags.is_empty() {
        panic!("CANDLE_FLASH_CUDA_ARCHS={spec:?} names no target");
    }
    flags
}

fn check_cc(cc: &str, spec: &str) {
    let digits = cc.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
        panic!(
            "CANDLE_FLASH_CUDA_ARCHS={spec:?}: cannot understand {cc:?}; use e.g. \
             `80 90a compute_90` or explicit `-gencode=...` flags"
        );
    }
}

fn find_nvcc(roots: &[PathBuf]) -> PathBuf {
    if let Some(n) = env_nonempty("NVCC") {
        let p = PathBuf::from(n);
        if p.is_file() {
            return p;
        }
        panic!("candle-flash: NVCC={} does not exist", p.display());
    }
    for root in roots {
        let p = root.join("bin").join("nvcc");
        if p.is_file() {
            return p;
        }
    }
    println!("cargo:rerun-if-env-changed=PATH");
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "candle-flash: feature `cuda` needs nvcc, but none was found (looked at $NVCC, \
         $CUDA_ROOT/bin, $CUDA_PATH/bin, $CUDA_HOME/bin and PATH). Install it with \
         `scripts/install-cuda.sh` and `source .cuda/env.sh`."
    );
}

enum CompileResult {
    UpToDate(PathBuf),
    Ok { obj: PathBuf, stderr: String },
    Failed { cmd: String, stderr: String },
}

fn compile_one(nvcc: &Path, common: &[String], src: &Path, obj_dir: &Path, cwd: &Path) -> CompileResult {
    // Object name from the path below kernels/ (sm80/fwd.cu -> sm80_fwd.o): stems repeat across folders.
    let rel = src.strip_prefix(cwd.join("kernels")).unwrap_or(src);
    let stem = rel.with_extension("").to_string_lossy().replace(['/', '\\'], "_");
    let obj = obj_dir.join(format!("{stem}.o"));
    let dep = obj_dir.join(format!("{stem}.d"));
    let cmd_file = obj_dir.join(format!("{stem}.cmd"));

    let mut args: Vec<String> = common.to_vec();
    args.extend([
        "-MD".into(),
        "-MF".into(),
        dep.display().to_string(),
        "-c".into(),
        src.display().to_string(),
        "-o".into(),
        obj.display().to_string(),
    ]);
    let cmd_line = format!("{} {}", nvcc.display(), args.join(" "));

    if up_to_date(&obj, &dep, &cmd_file, &cmd_line, cwd) {
        return CompileResult::UpToDate(obj);
    }
    let _ = fs::remove_file(&cmd_file);

    let out = match Command::new(nvcc).args(&args).current_dir(cwd).output() {
        Ok(o) => o,
        Err(e) => {
            return CompileResult::Failed { cmd: cmd_line, stderr: format!("cannot run {}: {e}", nvcc.display()) }
        }
    };
    let mut stderr = String::from_utf8_lossy(&out.stdout).into_owned();
    stderr.push_str(&String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        let _ = fs::remove_file(&obj);
        return CompileResult::Failed { cmd: cmd_line, stderr: format!("{stderr}\n(nvcc {})", out.status) };
    }
    let _ = fs::write(&cmd_file, &cmd_line);
    CompileResult::Ok { obj, stderr }
}

fn mtime(p: &Path) -> Option<SystemTime> {
    fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// Object exists, was built by the same command, and no dependency listed in the
/// nvcc-generated make-style .d file is newer than it.
fn up_to_date(obj: &Path, dep: &Path, cmd_file: &Path, cmd_line: &str, cwd: &Path) -> bool {
    let (Some(obj_t), Ok(old_cmd), Ok(d)) = (mtime(obj), fs::read_to_string(cmd_file), fs::read_to_string(dep)) else {
        return false;
    };
    if old_cmd != cmd_line {
        return false;
    }
    let joined = d.replace("\\\r\n", " ").replace("\\\n", " ");
    let mut n = 0;
    for line in joined.lines() {
        let Some((_, deps)) = line.split_once(": ") else {
            continue;
        };
        let deps = deps.replace("\\ ", "\u{0}");
        for p in deps.split_whitespace() {
            let p = PathBuf::from(p.replace('\u{0}', " "));
            let p = if p.is_absolute() { p } else { cwd.join(p) };
            match mtime(&p) {
                Some(t) if t <= obj_t => n += 1,
                _ => return false,
            }
        }
    }
    n > 0
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            println!("cargo:rerun-if-changed={}", p.display());
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}
