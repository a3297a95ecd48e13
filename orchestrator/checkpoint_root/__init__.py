"""A checkpoint root: who writes it (the writer marker), what a restart-tier script keeps."""
