//! Tests of the cache lab (none yet: the lab is not built).
