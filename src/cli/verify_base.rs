//! `production-lab verify-base URL`: the consumer-contract verifier, as a real HTTP client of a
//! running fixture.

use clap::Args;
use production_lab::labs::contracts::verify;

#[derive(Args)]
pub struct VerifyBaseArgs {
    /// The fixture's root, e.g. http://127.0.0.1:5080/ (http, loopback, no path or user info).
    pub url: String,
}

pub fn run(args: VerifyBaseArgs) -> anyhow::Result<()> {
    println!("{}", verify::run(&args.url)?);
    Ok(())
}
