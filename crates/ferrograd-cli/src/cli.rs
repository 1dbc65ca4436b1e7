//! Command-line definitions and dispatch. Configuration is explicit: every knob is a flag.

use clap::{Args, Parser, Subcommand};
use ferrograd::backend::cuda::{compile_all_kernels, cuda_info, emit_all_ptx, fill_kernel_cache};
use ferrograd::demo::{self, DemoConfig};
use ferrograd::{Device, memory};

#[derive(Parser, Debug)]
#[command(
    name = "ferrograd",
    version,
    about = "A training engine that accounts for every byte"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train a character-level GPT (the main job; the default without a subcommand).
    Train(Box<crate::train::TrainArgs>),
    /// The peak memory of `train` with the same flags, planned before anything runs: by
    /// category and phase, with alternatives, and what fits a --budget.
    Plan(Box<crate::plan::PlanArgs>),
    /// Gradient memory of Linear-ReLU-Linear, before/after backward, peak, by category.
    Demo(DemoArgs),
    /// Devices, their memory, and library versions.
    Info(InfoArgs),
    /// Start N processes on this machine, one per rank, with the variables torchrun sets
    /// (RANK, WORLD_SIZE, MASTER_ADDR, ...): `ferrograd launch --nproc-per-node 2 -- CMD...`.
    Launch(crate::launch::LaunchArgs),
}

#[derive(Args, Debug)]
struct InfoArgs {
    /// Compile and load every kernel module on each GPU, on all host threads, into the
    /// kernel cache: later runs on this machine compile nothing (a fresh machine otherwise
    /// spends minutes of first use on it, one module at a time).
    #[arg(long)]
    compile_kernels: bool,
    /// Compile every kernel module for --arch into the kernel cache with NVRTC alone, no GPU
    /// needed: a GPU machine that is given the folder (FERROGRAD_KERNEL_CACHE) and has the same
    /// NVRTC version then compiles nothing.
    #[arg(long, conflicts_with = "compile_kernels")]
    fill_kernel_cache: bool,
    /// Write every kernel module's PTX, as NVRTC compiles it for --arch, into this folder
    /// (`<module>.ptx`), to read what the kernels compile to without a GPU: `ptxas -v`,
    /// `cuobjdump -sass`, scripts/check_wgmma.sh. Needs NVRTC only.
    #[arg(long, value_name = "DIR")]
    emit_ptx: Option<std::path::PathBuf>,
    /// The GPU architecture --emit-ptx and --fill-kernel-cache compile for (an H100 or H200
    /// is sm_90a).
    #[arg(long, default_value = "sm_90a")]
    arch: String,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Width d of both Linear(d, d) layers.
    #[arg(long, default_value_t = 10_000)]
    dim: usize,
    /// Batch size B of the (B, d) input.
    #[arg(long, default_value_t = 1_000)]
    batch: usize,
    /// cpu, cuda, cuda:N
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Seed for the weights and the input.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Record every allocation and write memory_snapshot.pickle (pytorch.org/memory_viz),
    /// memory_trace.json (Perfetto, chrome://tracing) and memory_report.html into DIR.
    #[arg(long, value_name = "DIR")]
    memory_trace: Option<std::path::PathBuf>,
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    let default = || Command::Train(Box::new(crate::train::TrainArgs::defaults()));
    match cli.command.unwrap_or_else(default) {
        Command::Train(a) => crate::train::run(*a),
        Command::Plan(a) => crate::plan::run(*a),
        Command::Demo(a) => run_demo(a),
        Command::Info(a) => run_info(a),
        Command::Launch(a) => crate::launch::run(a),
    }
}

fn run_demo(a: DemoArgs) -> anyhow::Result<()> {
    let device: Device = a.device.parse()?;
    let cfg = DemoConfig {
        dim: a.dim,
        batch: a.batch,
        device,
        seed: a.seed,
        memory_trace: a.memory_trace,
    };
    let report = demo::run(&cfg)?;
    if a.json {
        println!("{}", demo::to_json(&report));
    } else {
        print!("{}", demo::render(&report));
    }
    Ok(())
}

fn run_info(a: InfoArgs) -> anyhow::Result<()> {
    println!("ferrograd {}", env!("CARGO_PKG_VERSION"));
    let cpu = memory::allocator(Device::Cpu)?.mem_info();
    println!(
        "cpu      {} threads, {} total, {} available",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        memory::format_size(cpu.total),
        memory::format_size(cpu.free)
    );
    let info = cuda_info();
    let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "not found".into());
    println!(
        "cuda     driver {}, nvrtc {}, cublas {}",
        show(&info.driver_version),
        show(&info.nvrtc_version),
        show(&info.cublas_version)
    );
    for g in &info.devices {
        println!(
            "cuda:{}   {} ({}), {} total, {} free",
            g.ordinal,
            g.name,
            g.arch,
            memory::format_size(g.total_bytes),
            memory::format_size(g.free_bytes)
        );
    }
    match &info.kernel_cache {
        Some(c) => println!(
            "kernels  cached in {} ({} modules, {}, {} tuned GEMM problems; FERROGRAD_KERNEL_CACHE moves it, =off turns it off)",
            c.dir.display(),
            c.modules,
            memory::format_size(c.bytes),
            c.gemm_choices
        ),
        None => println!(
            "kernels  not cached (FERROGRAD_KERNEL_CACHE is off, or there is no home folder)"
        ),
    }
    if let Some(note) = &info.note {
        println!("note     {note}");
    }
    if let Some(dir) = &a.emit_ptx {
        let files = emit_all_ptx(dir, &a.arch)?;
        println!(
            "ptx      {} kernel modules for {} in {}",
            files.len(),
            a.arch,
            dir.display()
        );
    }
    if a.fill_kernel_cache {
        let f = fill_kernel_cache(&a.arch)?;
        println!(
            "kernels  {} modules for {} in {} ({} compiled now) in {:.1} s",
            f.modules,
            a.arch,
            f.dir.display(),
            f.compiled_now,
            f.seconds
        );
    }
    if a.compile_kernels {
        if info.devices.is_empty() {
            anyhow::bail!("--compile-kernels needs a CUDA GPU, and none was found");
        }
        for g in &info.devices {
            let w = compile_all_kernels(g.ordinal)?;
            println!(
                "cuda:{}   {} kernel modules ready ({} loaded now) in {:.1} s on {} threads",
                g.ordinal, w.modules, w.loaded_now, w.seconds, w.threads
            );
        }
    }
    Ok(())
}
