"""Job config: YAML + overrides, unknown keys and bad values rejected with the field named."""
from __future__ import annotations


import pytest

from jobs.generate import main
from pipeline.config import ConfigError, JobConfig
from pipeline.config_file import load_config
from support.paths import REPO

BASE = {"input": {"paths": ["in/"]}, "output": {"path": "out/x"}, "model": {"path": "m"}}


def _with(section: str, **fields) -> dict:
    data = {k: dict(v) for k, v in BASE.items()}
    data.setdefault(section, {}).update(fields)
    return data


def test_demo_config_loads():
    cfg = load_config(REPO / "examples" / "demo.yaml")
    assert cfg.model.path == "models/tiny-orthrus-py"
    assert cfg.input.paths == ["examples/shards/"]
    assert cfg.output.path == "out/demo" and cfg.behaviour.overwrite


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("input: {paths: [a.parquet]}\noutput: {path: o}\nmodel: {path: m}\n")
    cfg = load_config(f, ["sampling.temperature=0.7", 'sampling.stop=["\\n\\n", END]', "engine.speculative=false",
                          "resources.replicas=3"])
    assert cfg.sampling.temperature == 0.7 and cfg.sampling.stop == ["\n\n", "END"]
    assert cfg.engine.speculative is False and cfg.resources.replicas == 3
    assert load_config(f, ["engine.speculative=auto"]).engine.speculative == "auto"
    assert load_config(f, ["prompt.chat_template=off"]).prompt.chat_template == "off"   # YAML bool
    assert cfg.sampling.n == 1 and cfg.prompt.chat_template == "auto"
    assert cfg.engine.prefix_cache is True and load_config(f, ["engine.prefix_cache=false"]).engine.prefix_cache is False


@pytest.mark.parametrize("section, fields, field_path", [
    ("sampling", {"temperature": -1}, "sampling.temperature"),
    ("sampling", {"top_p": 0}, "sampling.top_p"),
    ("sampling", {"top_p": 1.5}, "sampling.top_p"),
    ("sampling", {"top_k": -2}, "sampling.top_k"),
    ("sampling", {"max_new_tokens": 0}, "sampling.max_new_tokens"),
    ("sampling", {"n": 0}, "sampling.n"),
    ("sampling", {"stop": [""]}, "sampling.stop"),
    ("sampling", {"stop_token_ids": [-1]}, "sampling.stop_token_ids"),
    ("sampling", {"temprature": 0.5}, "sampling.temprature"),
    ("engine", {"max_batch_size": 0}, "engine.max_batch_size"),
    ("engine", {"block_size": 1}, "engine.block_size"),
    ("engine", {"dtype": "float8"}, "engine.dtype"),
    ("engine", {"attention": "xformers"}, "engine.attention"),
    ("engine", {"attention": "flash", "dtype": "float32"}, "engine"),
    ("engine", {"prefix_cache": "x"}, "engine.prefix_cache"),
    ("engine", {"kv_cache_tokens": 0}, "engine.kv_cache_tokens"),
    ("engine", {"kv_cache_tokens": 100, "max_seq_len": 128, "block_size": 4}, "engine"),
    ("prompt", {"chat_template": "maybe"}, "prompt.chat_template"),
    ("resources", {"cpus_per_replica": 0}, "resources.cpus_per_replica"),
    ("behaviour", {"resume": True, "overwrite": True}, "behaviour"),
    ("input", {"paths": []}, "input.paths"),
])
def test_invalid_values_name_the_field(section, fields, field_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, data=_with(section, **fields))
    assert f"  {field_path}" in str(err.value), str(err.value)


def test_unknown_and_missing_sections():
    with pytest.raises(ConfigError, match=r"samplin: unknown field"):
        load_config(None, data={**BASE, "samplin": {}})
    with pytest.raises(ConfigError, match=r"model: Field required"):
        load_config(None, data={k: v for k, v in BASE.items() if k != "model"})


def test_bad_override_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["sampling.temperature"], data=BASE)
    with pytest.raises(ConfigError, match=r"sampling.nope: unknown field"):
        load_config(None, ["sampling.nope=1"], data=BASE)
    bad = tmp_path / "bad.yaml"
    bad.write_text("input: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_every_field_is_described():
    def walk(model):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, JobConfig.__mro__[1]):
                assert ann.model_config.get("extra") == "forbid"
                walk(ann)
    walk(JobConfig)


def test_cli_rejects_bad_config_before_anything_runs(tmp_path, capsys):
    f = tmp_path / "job.yaml"
    f.write_text("input: {paths: [a.parquet]}\noutput: {path: o}\nmodel: {path: m}\nsampling: {top_p: 2}\n")
    assert main(["--config", str(f)]) == 2
    assert "sampling.top_p" in capsys.readouterr().err
    assert main(["--config", str(f), "--resume", "--overwrite"]) == 2
    assert "mutually exclusive" in capsys.readouterr().err


@pytest.mark.parametrize("max_new, rows", [(1, 1024), (3, 341), (4, 256), (16, 64), (64, 64), (4096, 64)])
def test_rows_per_call_are_sized_by_work_unless_set(max_new, rows):
    base = {"input": {"paths": ["x"]}, "output": {"path": "y"}, "model": {"path": "m"},
            "sampling": {"max_new_tokens": max_new}}
    assert load_config(None, data=base).batch_rows == rows
    assert load_config(None, data={**base, "engine": {"batch_size": 7}}).batch_rows == 7


def test_engine_settings_keep_one_name_from_the_yaml_to_the_engine():
    """Every engine setting a job can set has the engine's own name, and maps onto it by name
    (``key_bucket`` is the engine's test knob, not a job setting)."""
    from orthrus import EngineSettings
    from pipeline.config import EngineKwargs

    assert set(EngineSettings.names()) - {"key_bucket"} <= set(EngineKwargs.model_fields)
    e = EngineKwargs(max_batch_size=3, block_size=4, static_shapes=False, max_num_batched_tokens=64,
                     adaptive_verify=False, speculative="auto", compile=True)
    s = e.engine_settings(max_batch_size=5)
    assert (s.max_batch_size, s.block_size, s.static_shapes, s.max_num_batched_tokens, s.adaptive_verify,
            s.speculative, s.compile) == (5, 4, False, 64, False, "auto", True)
    # engine.compile unset: the device decides (on for CUDA, off on a CPU)
    assert EngineKwargs().engine_settings().compile is None
    assert [EngineSettings().resolved(4, 128, d).compile for d in ("cpu", "cuda")] == [False, True]
    # the former name still reads: true = the default (on for GPU), false = eager
    assert EngineKwargs(cuda_graphs=False).static_shapes is False and EngineKwargs(cuda_graphs=True).static_shapes is None
    with pytest.raises(ValueError, match="former name of static_shapes"):
        EngineKwargs(cuda_graphs=False, static_shapes=True)


def test_engine_settings_are_checked_naming_the_field():
    from orthrus import EngineSettings

    for bad, field in (({"max_batch_size": 0}, "max_batch_size"), ({"block_size": 1}, "block_size"),
                       ({"speculative": "yes"}, "speculative"), ({"attention": "xformers"}, "attention"),
                       ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"), ({"compile": "yes"}, "compile")):
        with pytest.raises(ValueError, match=field):
            EngineSettings(**bad).resolved(4, 128, "cpu")
    assert EngineSettings().resolved(4, 128, "cpu").max_seq_len == 128
