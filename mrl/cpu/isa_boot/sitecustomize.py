"""Python runs this at start-up in every process whose PYTHONPATH holds this folder, which only
`mrl.cpu.isa.forced_environment` puts there: it applies MRL_CPU_ISA (see that module) before vLLM can pick
its kernel library. A Python without mrl (another interpreter the command starts) is left alone."""

try:
    from mrl.cpu.isa import install_forced_level
except ImportError:
    pass
else:
    install_forced_level()
