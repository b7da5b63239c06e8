//! The simulator's child process for the tests: hosts the inbox on the backend given as JSON in
//! its one argument (see `lab_testkit::simulate::host`). `production-lab simulate --host` does
//! the same for the command line.

use std::process::ExitCode;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let Some(backend) = std::env::args().nth(1) else {
        eprintln!("usage: sim-host BACKEND_JSON");
        return ExitCode::from(2);
    };
    match lab_testkit::simulate::host::serve(&backend).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("sim-host: {error}");
            ExitCode::FAILURE
        }
    }
}
