"""The ways in from outside: the command line (`cli/`), the OpenAI-compatible HTTP server
(`http/`) and the benchmarks (`bench/`, run by `edgellm bench`)."""
