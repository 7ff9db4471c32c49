//! The `courier` binary: servers (`dev`, `broker`, `gateway`) and the client side
//! (`job ...`, `worker`, `status`). Thin: everything real lives in the library crates.

/// `println!` for a command's output. When stdout is closed (`courier job get KEY
/// --json | head -c 100`), the command stops quietly, with the exit status of a
/// process killed by SIGPIPE as other Unix tools have, instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)), true)
    };
}

/// `print!` for a command's output; see [`out!`].
macro_rules! out_raw {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!($($arg)*), true)
    };
}

/// `println!` for the worker's report of each job: a worker whose stdout was closed
/// goes on running jobs (they are its point, not the report).
macro_rules! report {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)), false)
    };
}

mod client_cmds;
mod dev;
mod security;
mod servers;
mod status_page;
mod telemetry;
mod worker_cmd;

/// Writes to stdout; a failed write ends the process (status 141 for a closed pipe,
/// 1 otherwise) when `fatal`, and is ignored when not.
pub(crate) fn write_stdout(args: std::fmt::Arguments<'_>, fatal: bool) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    if let Err(e) = stdout.write_fmt(args).and_then(|()| stdout.flush()) {
        if fatal {
            drop(stdout);
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                eprintln!("error: cannot write the output: {e}");
                std::process::exit(1);
            }
            std::process::exit(141);
        }
    }
}

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "courier",
    version,
    about = "Courier: a clustered job-push broker"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a whole cluster (brokers and a gateway) in this process.
    Dev(dev::DevArgs),
    /// Run one broker of a multi-process cluster.
    Broker(servers::BrokerArgs),
    /// Run a gateway in front of a cluster's brokers.
    Gateway(servers::GatewayArgs),
    /// Create, inspect and drive jobs.
    Job {
        #[command(flatten)]
        conn: client_cmds::ClientOpts,
        #[command(subcommand)]
        cmd: client_cmds::JobCmd,
    },
    /// Run a shell command for every job of a type, until Ctrl-C.
    Worker {
        #[command(flatten)]
        conn: client_cmds::ClientOpts,
        #[command(flatten)]
        args: worker_cmd::WorkerArgs,
    },
    /// Show the cluster's brokers, partitions, leaders and health.
    Status {
        #[command(flatten)]
        conn: client_cmds::ClientOpts,
    },
    /// Count jobs per type and tenant: waiting, oldest, active, incidents, rate.
    Stats {
        #[command(flatten)]
        conn: client_cmds::ClientOpts,
        #[command(flatten)]
        args: client_cmds::inspect::StatsArgs,
    },
    /// List incidents with their errors, or retry or cancel them over a filter.
    Incidents {
        #[command(flatten)]
        conn: client_cmds::ClientOpts,
        #[command(flatten)]
        args: client_cmds::inspect::IncidentsArgs,
    },
    /// Make a cluster CA and certificates signed by it (for TLS and mutual TLS).
    #[command(subcommand)]
    Cert(security::CertCmd),
}

/// mimalloc instead of the system allocator: the job path allocates many small,
/// short-lived buffers (protobuf and JSON messages, HTTP/2 frames), where glibc's
/// malloc cost about a tenth of the brokers' CPU (see benchmarks/RESULTS.md).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = match runtime(cli.cmd.worker_threads()) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the tokio runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let telemetry = match cli.cmd.log_filter() {
        Some(filter) => {
            let _in_runtime = runtime.enter();
            match servers::init_tracing(filter, cli.cmd.otlp()) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    return std::process::ExitCode::FAILURE;
                }
            }
        }
        None => telemetry::Telemetry::default(),
    };
    let result = runtime.block_on(async move {
        match cli.cmd {
            Cmd::Dev(a) => dev::dev(a).await,
            Cmd::Broker(a) => servers::broker(a).await,
            Cmd::Gateway(a) => servers::gateway(a).await,
            Cmd::Job { conn, cmd } => client_cmds::job(conn, cmd).await,
            Cmd::Worker { conn, args } => worker_cmd::worker(conn, args).await,
            Cmd::Status { conn } => client_cmds::status(conn).await,
            Cmd::Stats { conn, args } => client_cmds::inspect::stats(&conn, args).await,
            Cmd::Incidents { conn, args } => client_cmds::inspect::incidents(&conn, args).await,
            Cmd::Cert(c) => security::cert(c),
        }
    });
    {
        let _in_runtime = runtime.enter();
        telemetry.shutdown();
    }
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

impl Cmd {
    /// What a command logs by default: the servers their own, the client side its
    /// warnings on stderr (a stream that broke, a poll that failed, a call still
    /// retrying while the gateway does not answer); `RUST_LOG` shows more. `None`:
    /// no logging.
    fn log_filter(&self) -> Option<&'static str> {
        match self {
            Cmd::Dev(_) | Cmd::Broker(_) | Cmd::Gateway(_) => Some(servers::SERVER_LOG),
            Cmd::Cert(_) => None,
            _ => Some("warn"),
        }
    }

    /// Where this process exports spans, and its service name there.
    fn otlp(&self) -> Option<(&str, &'static str)> {
        let (args, service) = match self {
            Cmd::Dev(a) => (&a.otlp, "courier-dev"),
            Cmd::Broker(a) => (&a.otlp, "courier-broker"),
            Cmd::Gateway(a) => (&a.otlp, "courier-gateway"),
            Cmd::Worker { args, .. } => (&args.otlp, "courier-worker"),
            _ => return None,
        };
        Some((args.otlp_endpoint.as_deref()?, service))
    }

    /// The runtime's worker threads: what the servers were told, else dev's own
    /// default and tokio's for the rest (`TOKIO_WORKER_THREADS`, else one per CPU).
    fn worker_threads(&self) -> Option<usize> {
        match self {
            Cmd::Dev(a) => Some(a.runtime.worker_threads()),
            Cmd::Broker(a) => a.runtime.worker_threads(),
            Cmd::Gateway(a) => a.runtime.worker_threads(),
            Cmd::Job { .. }
            | Cmd::Worker { .. }
            | Cmd::Status { .. }
            | Cmd::Stats { .. }
            | Cmd::Incidents { .. }
            | Cmd::Cert(_) => None,
        }
    }
}

/// The multi-threaded scheduler at every size, one worker included: the runtime
/// behaves the same whatever it is given, and its workers are its own threads,
/// never the main thread.
fn runtime(worker_threads: Option<usize>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.enable_all();
    if let Some(n) = worker_threads {
        b.worker_threads(n);
    }
    b.build()
}
