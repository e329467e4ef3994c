"""The offline checks of scripts/validate-deploy, which installs the tools and runs this.

The tools do the checking; this only feeds them and checks what none of them can see:

- `docker compose config` (Docker Compose itself) reads docker-compose.yml alone and with each
  override deploy/compose/*.yml: each file against the Compose Specification's schema, merged by
  Compose's own rules (`!reset`, `!override`), references to services and volumes resolved.
- `kubectl kustomize` (kustomize itself) builds deploy/kubernetes and every overlay beside it, and
  kubernetes-validate checks every object built against the Kubernetes API's schemas in strict
  mode (an unknown field is an error), for the oldest version the manifests support (1.29: native
  sidecars) and the newest it knows. cert-manager's Certificate has no schema in any registry
  package: only the references below are checked of it.
- `idemgate check` reads every config a compose file or a pod mounts, as the container sees it:
  the paths it names inside a mount (TLS certificates and keys) are read from what is mounted
  there. The TLS demo's certificates come from a run of a scratch copy of deploy/compose/make-certs;
  a cert-manager Certificate's Secret (tls.crt, tls.key, ca.crt) from the same run.
- Checked here, since neither a tool nor the container test (scripts/test-containers, which runs
  the compose files and deploy/kubernetes for real) does: Service selectors and target ports, workload selectors, a
  Certificate's dnsNames naming a Service; no TLS file through a subPath mount (it would never see
  a renewal); an override's or overlay's copy of the gateway's config differs from the base's in
  TLS settings only (or also in [store], for another backend); an override that replaces Redis's
  command keeps its durability flags; every manifest beside a kustomization is used by it; every
  file make-certs writes is ignored by git.

  python3 deploy/validate/validate.py   (from the repository root; COMPOSE, KUBECTL, IDEMGATE and
                                         SCRATCH name the tools and a scratch directory)
"""

import base64
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import yaml

COMPOSE, KUBECTL, IDEMGATE = os.environ["COMPOSE"], os.environ["KUBECTL"], os.environ["IDEMGATE"]
SCRATCH = Path(os.environ["SCRATCH"])
ROOT = Path.cwd()
KUBE_VERSIONS = ["1.29", "1.37"]
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
SHOWN = {}  # scratch files -> what they stand for, in messages
failures = 0


def report(label, errors):
    global failures
    print(f"{'FAIL' if errors else 'OK  '}  {label}")
    for e in errors:
        print("        " + e.replace("\n", "\n          "))
    failures += bool(errors)


def run(cmd, errors, name=None):
    """cmd's output, or None and what it said in errors (scratch paths named as what they stand for)."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip()
        for path in sorted(SHOWN, key=len, reverse=True):
            said = said.replace(path, SHOWN[path])
        errors.append(f"{name or Path(cmd[0]).name}: {said}")
        return None
    return r.stdout


def rel(p):
    p = str(p)
    if p in SHOWN:
        return SHOWN[p]
    for base, name in ((str(SCRATCH), "(scratch)"), (str(ROOT), ".")):
        if p == base or p.startswith(base + "/"):
            return name + p[len(base):] if name != "." else p[len(base) + 1:] or "."
    return p


def strings(value, key=""):
    """(key, string) for every string in a parsed TOML value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v, key)
    elif isinstance(value, str):
        yield key, value


def check_config(label, config_path, mounts, configs):
    """`idemgate check` on the config a container reads at config_path. mounts: [(target, host
    path, subPath?)]. Each path the config names inside a mount is read from the host path."""
    def host(p):
        hits = [m for m in mounts if p == m[0] or p.startswith(m[0].rstrip("/") + "/")]
        if not hits:
            return None
        target, src, sub = max(hits, key=lambda m: len(m[0]))
        return Path(str(src) + p[len(target.rstrip("/")):]), sub

    errors = []
    found = host(config_path)
    if not found or not found[0].is_file():
        report(f"{label}: idemgate check", [f"nothing is mounted at {config_path}, the config it reads"])
        return
    text = found[0].read_text()
    try:
        parsed = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        parsed = {}  # idemgate check says what is wrong with it
    configs[label] = (rel(found[0]), parsed)
    for key, value in strings(parsed):
        if value.startswith("/") and (h := host(value)):
            if h[1] and key.startswith("tls_"):
                errors.append(f"{key} = {value!r} is under a subPath mount, a copy made when the container "
                              "starts that never sees a renewal: mount the whole Secret as a directory")
            SHOWN.setdefault(str(h[0]), value)  # idemgate names the file as the container sees it
            text = text.replace(f'"{value}"', json.dumps(str(h[0]))).replace(f"'{value}'", json.dumps(str(h[0])))
    mapped = SCRATCH / "configs" / (label.replace("/", "_").replace(" ", "_") + ".toml")
    mapped.parent.mkdir(parents=True, exist_ok=True)
    mapped.write_text(text)
    SHOWN[str(mapped)] = rel(found[0])
    if run([IDEMGATE, "check", "--config", str(mapped)], errors, "idemgate check") is None:
        errors.append("mounted: " + ", ".join(f"{t} <- {rel(s)}" for t, s, _ in mounts))
    report(f"{label}: idemgate check {rel(found[0])} (as mounted at {config_path})", errors)


def tls_only_differences(a, b, other_store, at=""):
    """Where two configs differ in more than tls_* keys and the s of rediss:// and https://."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (k for k in sorted({*a, *b}) if not k.startswith("tls_") and not (other_store and not at and k == "store"))
        return [d for k in keys for d in tls_only_differences(a.get(k), b.get(k), other_store, f"{at}.{k}".lstrip("."))]
    plain = lambda v: v.replace("rediss://", "redis://").replace("https://", "http://") if isinstance(v, str) else v  # noqa: E731
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tls_only_differences(x, y, other_store, f"{at}[{i}]")]
    return [] if plain(a) == plain(b) else [at]


def compare_configs(label, base, copy):
    """An override's or overlay's copy of the gateway's config against the base's."""
    (base_file, a), (copy_file, b) = base, copy
    backend = lambda c: c.get("store", {}).get("backend", "memory")  # noqa: E731
    sentinels = lambda c: "sentinels" in c.get("store", {})  # noqa: E731
    other = backend(a) != backend(b) or sentinels(a) != sentinels(b)
    diff = tls_only_differences(a, b, other)
    report(f"{label}: {copy_file} differs from {base_file} in TLS settings only" + (" and [store]" if other else ""),
           [f"also in: {', '.join(diff)} (keep the two alike)"] if diff else [])


# --- deploy/compose/make-certs: run a scratch copy (its files are the TLS demo's mounts) -------
def make_certs():
    errors = []
    script = SCRATCH / "compose" / "make-certs"
    script.parent.mkdir(parents=True)
    shutil.copy2("deploy/compose/make-certs", script)
    run([str(script)], errors)
    listed = (run(["deploy/compose/make-certs", "--list"], errors) or "").split()
    for f in listed:
        ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", f], capture_output=True, text=True)
        if ignored.returncode == 1:
            errors.append(f"{rel(f)}: written by make-certs but not ignored by git (a private key could be committed)")
        elif ignored.returncode != 0:
            errors.append(f"git check-ignore {rel(f)}: {ignored.stderr.strip()}")
    report("deploy/compose/make-certs (a scratch copy run; its files ignored by git)", errors)
    SHOWN[str(SCRATCH / "compose" / "tls")] = "deploy/compose/tls (made by a scratch copy of make-certs)"
    return {str(Path(f).parent): SCRATCH / "compose" / "tls" for f in listed}


def from_certs(src, certs):
    """A path make-certs writes, in the scratch copy's output."""
    for real, scratch in certs.items():
        if src == real or src.startswith(real + "/"):
            return str(scratch) + src[len(real):]
    return src


# --- Compose ----------------------------------------------------------------------------------
def compose(certs):
    base = "docker-compose.yml"
    projects = {}
    for override in [None, *sorted(str(p) for p in Path("deploy/compose").glob("*.yml"))]:
        files = [base] + ([override] if override else [])
        label = " + ".join(files)
        errors = []
        out = run([COMPOSE, *sum((["-f", f] for f in files), []), "config", "--format", "json"], errors, "docker compose config")
        report(f"{label}: docker compose config", errors)
        if out is None:
            continue
        project, configs = json.loads(out), {}
        for name, svc in project["services"].items():
            mounts, errors = [], []
            for v in svc.get("volumes", []):
                if v["type"] != "bind":
                    continue
                src = from_certs(v["source"], certs)
                if not Path(src).exists():
                    errors.append(f"services.{name}.volumes: bind source {rel(v['source'])} does not exist")
                mounts.append((v["target"], src, False))
            if errors:
                report(f"{label}: services.{name}", errors)
            for target, src, _ in mounts:
                if str(src).endswith(".toml"):
                    check_config(f"{label}: services.{name}", target, mounts, configs)
        if not configs:
            report(label, ["no service mounts an idemgate config (*.toml): nothing for idemgate check"])
        projects[override] = (project, configs)
    base_project, base_configs = projects.get(None, ({}, {}))
    for override, (project, configs) in projects.items():
        if override is None:
            continue
        # A replaced `command` (Redis's, in tls.yml) keeps every flag of the base's.
        errors = []
        for name, svc in base_project.get("services", {}).items():
            was, now = svc.get("command") or [], project["services"].get(name, {}).get("command") or []
            for i, flag in enumerate(was):
                value = was[i + 1] if i + 1 < len(was) and not was[i + 1].startswith("--") else None
                if flag.startswith("--") and not any(now[j] == flag and (value is None or now[j + 1:j + 2] == [value])
                                                     for j in range(len(now))):
                    errors.append(f"services.{name}.command leaves out docker-compose.yml's {flag} {value or ''}".rstrip())
        report(f"docker-compose.yml + {override}: every flag of the base's commands kept", errors)
        for label, cfg in configs.items():
            base_label = label.replace(f" + {override}", "")
            if base_label in base_configs and base_configs[base_label][0] != cfg[0]:
                compare_configs(f"docker-compose.yml + {override}", base_configs[base_label], cfg)


# --- Kubernetes -------------------------------------------------------------------------------
def kubernetes():
    # What cert-manager writes into a Certificate's Secret, stood in for by make-certs' files.
    issued = {key: SCRATCH / "compose" / "tls" / f for key, f in
              (("tls.crt", "gateway.pem"), ("tls.key", "gateway.key"), ("ca.crt", "ca.pem"))}
    configs_by_dir = {}
    for k in sorted(Path("deploy").glob("*/kustomization.yaml")):
        d = str(k.parent)
        errors = []
        try:  # kubectl kustomize says what is wrong with a kustomization that does not parse
            kz = yaml.safe_load(k.read_text())
            used = {*kz.get("resources", []), *(p["path"] for p in kz.get("patches", []) if "path" in p),
                    *kz.get("patchesStrategicMerge", [])}
            errors += [f"{f.name} is neither a resource nor a patch of {k}" for f in sorted(k.parent.glob("*.yaml"))
                       if f.name != k.name and f.name not in used]
        except (yaml.YAMLError, AttributeError, TypeError):
            pass
        out = run([KUBECTL, "kustomize", d], errors, "kubectl kustomize")
        report(f"{d}: kubectl kustomize", errors)
        if out is None:
            continue
        objs = [o for o in yaml.safe_load_all(out) if o]
        for o in objs:
            what = f"{d}: {o.get('apiVersion')} {o.get('kind')} {o.get('metadata', {}).get('name')}"
            errors = []
            if o.get("apiVersion", "").startswith("cert-manager.io/"):
                report(f"{what}: no schema (cert-manager's is in no registry package); references only", [])
                continue
            for v in KUBE_VERSIONS:
                try:
                    kubernetes_validate.validate(o, v, strict=True)
                except kubernetes_validate.ValidationError as e:
                    errors.append(f"Kubernetes {v}: {'.'.join(map(str, e.path)) or '(object)'}: {e.message}")
                except kubernetes_validate.SchemaNotFoundError as e:
                    errors.append(e.message)
            report(f"{what}: Kubernetes API schema (strict) {', '.join(KUBE_VERSIONS)}", errors)
        report(f"{d}: references", references(objs))
        by = lambda kind: {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}  # noqa: E731
        certificates = {o["spec"].get("secretName"): o for o in objs if o["kind"] == "Certificate"}
        configs = {}
        for w in (o for o in objs if o["kind"] in WORKLOADS):
            pod = w["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                args = c.get("command", []) + c.get("args", [])
                if "--config" not in args:
                    continue
                label = f"{d}: {w['kind']} {w['metadata']['name']} container {c['name']}"
                mounts, errors = [], []
                for m in c.get("volumeMounts", []):
                    v = volumes.get(m["name"])
                    files = volume_files(v, by("ConfigMap"), by("Secret"), certificates, issued, errors) if v else None
                    if v is None:
                        errors.append(f"mounts volume {m['name']!r}, which the pod does not have")
                    if files is None:
                        continue
                    where = SCRATCH / "kube" / d.replace("/", "_") / w["metadata"]["name"] / m["name"]
                    where.mkdir(parents=True, exist_ok=True)
                    what = (f"ConfigMap {v['configMap']['name']}" if "configMap" in v else
                            f"Secret {v['secret']['secretName']}" if "secret" in v else f"volume {m['name']}")
                    SHOWN[str(where)] = f"({what})"
                    for name, data in files.items():
                        SHOWN[str(where / name)] = f"{what}: {name}"
                        data = data.read_bytes() if isinstance(data, Path) else data
                        (where / name).write_bytes(data.encode() if isinstance(data, str) else data)
                    mounts.append((m["mountPath"], where / m["subPath"] if m.get("subPath") else where, bool(m.get("subPath"))))
                if errors:
                    report(f"{label}: volumes", errors)
                check_config(label, args[args.index("--config") + 1], mounts, configs)
        configs_by_dir[d] = configs
    base = configs_by_dir.get("deploy/kubernetes", {})
    for d, configs in configs_by_dir.items():
        for label, cfg in configs.items():
            base_label = label.replace(d, "deploy/kubernetes", 1)
            if d != "deploy/kubernetes" and base_label in base:
                compare_configs(d, (f"deploy/kubernetes's {base[base_label][0]}", base[base_label][1]), cfg)


def volume_files(v, config_maps, secrets, certificates, issued, errors):
    """A volume's files {name: text, bytes or a Path to copy}, or None if it is not mapped."""
    if "configMap" in v or "secret" in v:
        cm = "configMap" in v
        name = v["configMap"]["name"] if cm else v["secret"]["secretName"]
        if cm and name in config_maps:
            data = config_maps[name].get("data", {})
        elif not cm and name in secrets:
            s = secrets[name]
            data = {k: base64.b64decode(x) for k, x in s.get("data", {}).items()} | s.get("stringData", {})
        elif not cm and name in certificates:
            data = issued
        else:
            errors.append(f"volume {v['name']!r}: {'ConfigMap' if cm else 'Secret'} {name!r} is not built here"
                          + ("" if cm else " (nor issued by a Certificate here)"))
            return None
        items = (v["configMap"] if cm else v["secret"]).get("items")
        return {i["path"]: data[i["key"]] for i in items if i["key"] in data} if items else data
    return {} if "emptyDir" in v or "persistentVolumeClaim" in v else None


def references(objs):
    """What the API server does not check and podman kube play does not run: Services and selectors."""
    errors = []
    match = lambda sel, labels: all(labels.get(k) == x for k, x in (sel or {}).items())  # noqa: E731
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    workloads = [o for o in objs if o["kind"] in WORKLOADS]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        if not match(w["spec"].get("selector", {}).get("matchLabels"), labels):
            errors.append(f"{w['kind']} {w['metadata']['name']}: spec.selector does not match its pod template's labels")
        if w["kind"] == "StatefulSet" and w["spec"].get("serviceName") not in services:
            errors.append(f"StatefulSet {w['metadata']['name']}: serviceName {w['spec'].get('serviceName')!r} is not a Service here")
    for s in (s for s in services.values() if s["spec"].get("selector")):
        pods = [w["spec"]["template"] for w in workloads
                if match(s["spec"]["selector"], w["spec"]["template"]["metadata"].get("labels", {}))]
        if not pods:
            errors.append(f"Service {s['metadata']['name']}: its selector matches no pod template here")
        ports = [p for t in pods for c in t["spec"].get("containers", []) + [
            c for c in t["spec"].get("initContainers", []) if c.get("restartPolicy") == "Always"] for p in c.get("ports", [])]
        for p in s["spec"].get("ports", []) if pods else []:
            target = p.get("targetPort", p["port"])
            if not any(target in (cp["containerPort"], cp.get("name")) for cp in ports):
                errors.append(f"Service {s['metadata']['name']}: targetPort {target} is no port of the pods it selects")
    for c in (o for o in objs if o["kind"] == "Certificate"):
        if not any(n.split(".")[0] in services for n in c["spec"].get("dnsNames", [])):
            errors.append(f"Certificate {c['metadata']['name']}: no dnsNames entry names a Service here")
    return errors


if __name__ == "__main__":
    certs = make_certs()
    compose(certs)
    kubernetes()
    print("deploy files: all valid" if failures == 0 else f"deploy files: {failures} failed")
    sys.exit(1 if failures else 0)
