//! The `sealpost` command: the simulator today; the store, dispatchers and operator tools
//! as they land.

use clap::{Parser, Subcommand};

mod simulate;

#[derive(Parser, Debug)]
#[command(name = "sealpost", version, about = "Sealpost transactional outbox")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the deterministic fault-injecting simulator over the protocol core.
    Simulate(simulate::SimulateArgs),
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Simulate(a) => simulate::run(a),
    };
    match code {
        Ok(c) => std::process::exit(c),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
