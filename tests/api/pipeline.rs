//! Tests of the pipeline lab (none yet: the lab is not built).
