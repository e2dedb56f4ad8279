"""routewise's discrete-event simulator of vLLM replica fleets, as a library (no aiohttp, prometheus or torch).

Public modules:
- engine: `simulator.cluster` (ClusterSim, simulate), `simulator.replica` (Replica, with the wall-clock
  interface the emulator drives: add, abort, advance, tokens_generated, take_outputs), `simulator.costmodel`
- workloads and traces: `simulator.workload`, `simulator.traces`, `simulator.replay` (decision logs)
- scenarios: `simulator.scenario` (load_scenario, scenario_names)
- metrics: `simulator.metrics` (summarize, aggregate)
- experiments: `simulator.experiments` (run_once, compare, format_table)
- the routing environment training uses: `simulator.env.DecisionEnv`; its Gymnasium adapter `simulator.gym_env`
The `simulator` command (`simulator.cli`) is a thin layer over these; live tools are in the `fleet` package.
"""
