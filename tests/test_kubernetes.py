"""The Kubernetes manifests (workers/kubernetes, docs/CLUSTER.md): every document valid against a
pinned Kubernetes version's own schemas (kubernetes-validate, strict: no unknown field), and the
containers' commands and arguments run as written, $(VAR) expanded as the kubelet does, on
simulated servers (DFLASH_SIMULATE=1) against the test's Redis: the dataset enqueued by the Job,
beat, a GPU node's pod, which is stopped and started again under its own name mid-run (a pod
rescheduled), and Flower behind its auth."""
from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import datasets
import httpx
import kubernetes_validate
import pytest
import yaml
from support import ROOT, Proc, wait_until

from dflash_dev.local import free_port_run

MANIFESTS = ROOT / "workers" / "kubernetes"
KUBERNETES = "1.33.0"  # the version the manifests are checked against
SECRETS = {"redis-password": "unused-here", "flower-basic-auth": "operator:k8s-flower-pw"}


def documents() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(MANIFESTS.glob("*.yaml"))
            if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_manifest_is_valid_against_the_pinned_kubernetes_schemas():
    docs = documents()
    kinds = Counter(doc["kind"] for _, doc in docs)
    assert kinds == {"ConfigMap": 1, "Service": 2, "StatefulSet": 2, "Deployment": 2, "Job": 1}
    for name, doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    listed = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"]
    assert set(listed) == {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml",
                                                                         "enqueue-job.yaml"}


def test_a_manifest_that_breaks_the_schema_is_caught():
    (name, node), = [(n, d) for n, d in documents() if d["metadata"]["name"] == "dflash-node"]
    node["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(node, KUBERNETES, strict=True)


def container(name: str) -> dict:
    (doc,) = [d for _, d in documents() if d["metadata"]["name"] == name
              and d["kind"] in ("Deployment", "StatefulSet", "Job")]
    return doc["spec"]["template"]["spec"]["containers"][0]


def expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in command, args and env values: a defined variable's
    value, an undefined one left as written, $$ one $."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_env(spec: dict, config: dict[str, str], field: dict[str, str],
            overrides: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom's ConfigMap, then env in
    order (secretKeyRef from SECRETS, fieldRef from `field`, values expanded), then what the test
    sets in place of the cluster's (its Redis, its output directory)."""
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        env.update(config if source["configMapRef"]["name"] == "dflash" else {})
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif ref := var["valueFrom"].get("secretKeyRef"):
            if ref["key"] in SECRETS:
                env[var["name"]] = SECRETS[ref["key"]]
            else:
                assert ref.get("optional"), var
        else:
            env[var["name"]] = field[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return {**env, **overrides}


def argv(spec: dict, env: dict[str, str], mounts: dict[str, Path]) -> list[str]:
    """command + args as written, expanded; a volume's mount path is where the test mounted it."""
    out = []
    for part in [*spec["command"], *spec.get("args", [])]:
        part = expand(part, env)
        for path, local in mounts.items():
            if part == path or part.startswith(path + "/"):
                part = str(local) + part[len(path):]
        out.append(part)
    return out


def test_the_containers_commands_run_as_written_on_simulated_servers(redis_url, tmp_path):
    saved = tmp_path / "ultrachat"
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: what of {i * 31}?"}]}
            for i in range(120)]
    datasets.DatasetDict({"train_sft": datasets.Dataset.from_list(rows)}).save_to_disk(str(saved))
    config = {**yaml.safe_load((MANIFESTS / "config.yaml").read_text())["data"],
              "DATASET": str(saved), "JOB": "k8s"}
    del config["DFLASH_S3_URI"]  # the test's batches stay on its disk
    output = tmp_path / "output"
    overrides = {"DFLASH_REDIS_URL": redis_url, "DFLASH_OUTPUT_DIR": str(output),
                 "DFLASH_BATCH_ROWS": "20", "DFLASH_BATCH_MAX_AGE_S": "2", "HF_HUB_OFFLINE": "1",
                 # the image's interpreter: the project's environment
                 "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
    procs: list[Proc] = []

    def start(name: str, field: dict[str, str] | None = None, **more: str) -> Proc:
        spec = container(name)
        env = pod_env(spec, config, field or {}, {**overrides, **more})
        proc = Proc(argv(spec, env, {"/logs": tmp_path / f"{name}-logs"}),
                    tmp_path / "logs" / f"{name}.log", env=env, cwd=ROOT)
        procs.append(proc)
        return proc

    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    try:
        enqueue = start("dflash-enqueue")
        assert enqueue.popen.wait(timeout=120) == 0, enqueue.log()
        start("dflash-beat")
        pod = {"metadata.name": "dflash-node-0"}
        # Two GPUs given to the pod; servers slow enough that requests are in flight when it stops
        gpus = {"DFLASH_SIMULATE": "1", "CUDA_VISIBLE_DEVICES": "0,1",
                "DFLASH_SIM_ARGS": "--decode-tps 150 --median-tokens 600",
                "DFLASH_SGLANG_BASE_PORT": str(free_port_run(2))}  # 30000 may be another test's
        node = start("dflash-node", pod, **gpus)
        wait_until(lambda: int(r.hget("dflash:{k8s}:counters", "completed") or 0) >= 20,
                   timeout=180, interval=0.5, what=f"rows from the node's pod: {node.log()[-3000:]}")
        # Rescheduled: the pod stopped (SIGTERM, its grace period) with requests in flight, and
        # started again under its StatefulSet name, on whatever machine.
        assert sum(r.zcard(f"dflash:{{k8s}}:inflight:gpu{g}@dflash-node-0") for g in (0, 1)) > 0
        node.stop(timeout=120)
        assert "continued on another GPU" in (tmp_path / "dflash-node-logs" / "gpu0-worker.log")\
            .read_text() + (tmp_path / "dflash-node-logs" / "gpu1-worker.log").read_text()
        start("dflash-node", pod, **gpus)
        wait_until(lambda: r.hget("dflash:{k8s}:config", "status") == b"done", timeout=300,
                   interval=0.5, what="the job done after the pod's restart")
        port = 5555  # the manifest's
        flower = start("dflash-flower")
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/", timeout=5).status_code == 401,
                   timeout=60, what=f"Flower refusing a request without its auth: {flower.log()}")
        user, password = SECRETS["flower-basic-auth"].split(":")
        wait_until(lambda: {"gpu0@dflash-node-0", "gpu1@dflash-node-0"} <= set(httpx.get(
            f"http://127.0.0.1:{port}/api/workers?refresh=1", auth=(user, password),
            timeout=30).json()), timeout=60, what="Flower to list the pod's GPU workers")
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=30)
    from dflash_tasks.output.batches import read_batch, read_manifest
    from dflash_tasks.output.storage import LocalStorage

    storage = LocalStorage(output)
    made = Counter(row["id"] for rec in read_manifest(storage, "k8s")["batches"]
                   for row in read_batch(storage, rec))
    assert len(made) == 120 and max(made.values()) == 1
