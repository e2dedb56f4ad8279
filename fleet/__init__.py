"""Live-fleet tools: the vLLM emulator, the load generator, the CPU demo, the real-vLLM launcher and the
sim-to-real fidelity run.

Unlike `simulator` (a pure library), these serve and send real HTTP, so they may import aiohttp and
prometheus_client. Arrows point one way: fleet -> simulator -> router.policy.
"""
