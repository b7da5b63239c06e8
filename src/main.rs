//! The `production-lab` command line. It only parses arguments and hands over to [`cli`].

mod cli;

use std::process::ExitCode;

use clap::Parser;
use cli::Cli;
use production_lab::labs::contracts::verify;

/// mimalloc rather than the system allocator: a delivery allocates and frees a few hundred small
/// blocks across threads (request, JSON, rows, replies), and glibc's malloc, free and
/// consolidation were about 15% of the server's CPU under `bench ordered`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // A panic is a bug; still, the user sees one line, not a backtrace.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("production-lab: internal error: {info}")
    }));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) if !error.use_stderr() => {
            // --help and --version: print as clap renders them.
            let _ = error.print();
            return ExitCode::SUCCESS;
        }
        Err(error) => {
            // One readable line, like every other start-up refusal; --help has the rest.
            let rendered = error.render().to_string();
            // clap's message may span lines (e.g. the missing arguments under it); keep them,
            // drop the usage and tips that --help repeats.
            let message: Vec<&str> = rendered
                .lines()
                .map(str::trim)
                .take_while(|line| !line.starts_with("Usage:") && !line.starts_with("For more"))
                .filter(|line| !line.is_empty() && !line.starts_with("tip:"))
                .collect();
            eprintln!(
                "production-lab: {} (see --help)",
                message.join(" ").trim_start_matches("error: ")
            );
            return ExitCode::from(2);
        }
    };
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            match error.downcast_ref::<verify::VerifyError>() {
                // verify-base starts its line with the seed's words, as the seed's message is.
                Some(refusal) if refusal.starts_with_seed_words() => eprintln!("{refusal}"),
                _ => eprintln!("production-lab: {error:#}"),
            }
            ExitCode::FAILURE
        }
    }
}
