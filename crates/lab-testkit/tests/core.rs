//! The library's pure producer admission against the reference model's rule, over random
//! inputs: who delivers, under which epoch, to an aggregate with which owner and history. (The
//! delivery and resolution decisions are held to the model through a real store: the
//! `properties` and `simulate` tests.)

use lab_testkit::simulate::model::{Admitting, Producer, admission};
use ordered_inbox::facts::{OwnershipFacts, ProducerFact};
use ordered_inbox::producers::{Admission, admit};
use ordered_inbox::records::{AggregateOwner, ProducerClaim, refusal_outcome};
use proptest::prelude::*;

const NAMES: [&str; 2] = ["p", "q"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn producer_admission_decides_as_the_reference_model_says(
        producing in prop::option::of((0..2usize, 0..4i64, prop::bool::weighted(0.9))),
        offered in -1..5i64,
        owner in prop::option::of(0..2usize),
        history in prop::bool::ANY,
    ) {
        let claim = producing.map(|(name, _, _)| ProducerClaim {
            producer: NAMES[name].to_owned(),
            epoch: offered,
        });
        let facts = OwnershipFacts {
            producer: producing.map(|(_, current_epoch, active)| ProducerFact { current_epoch, active }),
            owner: owner.map(|owner| AggregateOwner { producer: NAMES[owner].to_owned(), epoch: 1 }),
            // An owned aggregate always has history.
            history: history || owner.is_some(),
        };
        let real = admit(claim.as_ref(), &facts)
            .map(|admission| matches!(admission, Admission::Claim(_)))
            .map_err(|refusal| refusal_outcome(&refusal));
        let modelled = admission(&Admitting {
            producer: producing.map(|(_, current_epoch, active)| Producer { current_epoch, active }),
            epoch: offered,
            owner: owner.map(|owner| NAMES[owner]),
            same_owner: matches!((owner, producing), (Some(o), Some((p, _, _))) if o == p),
            history: facts.history,
        });
        prop_assert_eq!(real, modelled);
    }
}
