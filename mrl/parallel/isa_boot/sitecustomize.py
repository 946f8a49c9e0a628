"""Python runs this at start-up in every process whose PYTHONPATH holds this folder, which only
`mrl.parallel.cpu_isa.forced_environment` puts there: it applies MRL_CPU_ISA (see that module) before vLLM can pick
its kernel library."""

from mrl.parallel.cpu_isa import install_forced_level

install_forced_level()
