//! `production-lab practice`: the lesson's companion practice, the ordering policy run over a
//! progression of `SEQUENCE:AMOUNT` deliveries.

use clap::Args;
use production_lab::labs::ordered::practice;

#[derive(Args)]
pub struct PracticeArgs {
    /// The aggregate's last applied sequence before the first delivery.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub last: i64,
    /// Deliveries as SEQUENCE:AMOUNT (default: the lesson's 2:1 1:1 2:-1 3:1 2:1).
    #[arg(allow_negative_numbers = true)]
    pub steps: Vec<String>,
}

pub fn run(args: PracticeArgs) -> anyhow::Result<()> {
    let steps = if args.steps.is_empty() {
        practice::LESSON_PROGRESSION.to_vec()
    } else {
        args.steps
            .iter()
            .map(|step| practice::parse_step(step))
            .collect::<Result<_, _>>()?
    };
    for line in practice::run(args.last, &steps) {
        println!("{line}");
    }
    Ok(())
}
