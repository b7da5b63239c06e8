//! Tests of the worker lab (none yet: the lab is not built).
