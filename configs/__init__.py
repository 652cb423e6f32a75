"""The shipped YAML configs; installed as `trace_mega.configs` (see setup.py), found by name
through `trace_mega.resources.resolve_config` (`trace-mega train --config demo_cpu`)."""
