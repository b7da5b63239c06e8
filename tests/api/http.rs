//! Tests of the http lab (none yet: the lab is not built).
