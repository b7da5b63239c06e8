//! The figures the server keeps: the HTTP edge's metric registry ([`metrics`]), built once per
//! application and handed to the doors, the inbox's wrapper, the labs and the edge middleware.

pub use http_edge::metrics;
