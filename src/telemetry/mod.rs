//! The figures the server keeps, below every door that counts into them: the metric registry
//! ([`metrics`]) is built once per application and handed to the doors, the inbox's wrapper, the
//! labs and the edge middleware, which record where each decision is known.

pub mod metrics;
