"""The NIXL agent Baton installs: Ray's nixl transport uses it, and it idles cheaply."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_rays_nixl_transport_uses_the_installed_agent_and_it_does_not_spin(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Process:
        def install_twice(self) -> str:
            from ray.experimental.rdt.util import get_tensor_transport_manager

            from workers.kv.nixl_agent import install_nixl_agent

            install_nixl_agent()
            manager = get_tensor_transport_manager("NIXL")
            agent = manager.get_nixl_agent()
            install_nixl_agent()
            assert manager.get_nixl_agent() is agent
            return agent.name

        def cpu_seconds_while_idle(self, seconds: float) -> float:
            import resource
            import time

            def used() -> float:
                r = resource.getrusage(resource.RUSAGE_SELF)
                return r.ru_utime + r.ru_stime

            before = used()
            time.sleep(seconds)
            return used() - before

    process = Process.remote()
    try:
        assert ray.get(process.install_twice.remote()).startswith("baton-")
        # Ray's own agent would poll without pause: ~1 s of CPU per second.
        assert ray.get(process.cpu_seconds_while_idle.remote(2.0)) < 0.5
    finally:
        ray.kill(process)


@pytest.mark.slow
def test_installing_after_ray_built_its_agent_is_refused(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Process:
        def install_late(self) -> str:
            from ray.experimental.rdt.util import get_tensor_transport_manager

            from workers.kv.nixl_agent import install_nixl_agent

            get_tensor_transport_manager("NIXL").get_nixl_agent()
            try:
                install_nixl_agent()
            except RuntimeError as e:
                return str(e)
            return "installed"

    process = Process.remote()  # Ray's spinning agent must not outlive the test
    try:
        assert "before the process's first nixl transfer" in ray.get(process.install_late.remote())
    finally:
        ray.kill(process)
