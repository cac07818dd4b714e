"""Configuration: TOML, flags, SageMaker import, and the serve command's --check."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kvroute.errors import ConfigError
from kvroute_server.cli import build_config, serve
from kvroute_server.config import (
    DEFAULT_STRATEGY,
    BackendConfig,
    ServerConfig,
    Setting,
    load_toml,
    parse_backend_flag,
    parse_option_flags,
    settings,
    toml_table,
)
from kvroute_server.proxy.slo import slo_choice
from kvroute_server.sagemaker import import_sagemaker, load_sagemaker

FULL_TOML = """
[server]
host = "0.0.0.0"
port = 9000
max_body_bytes = 1048576
max_attempts = 2
retry_after_s = 3
forward_authorization = false
backend_header = ""
admin_token = "0123456789abcdef0123"
access_log = false
passthrough_paths = ["/tokenize"]

[routing]
strategy = "bounded-load"
options = { prefix_length = 2048, load_factor = 1.5 }

[timeouts]
connect = 1.5
first_byte = 30
idle = 10

[health]
interval = 2
timeout = 0.5
unhealthy_threshold = 4
healthy_threshold = 3
passive_ejection = false
discover_models = false

[[backends]]
id = "a"
url = "http://10.0.0.1:8000/"
models = ["llama"]
weight = 2
labels = { zone = "z1" }
api_key = "secret"

[[backends]]
url = "http://10.0.0.2:8000"
kind = "openai"
adapter_options = { health_path = "/ping" }
"""


class TestToml:
    def test_every_key(self, tmp_path: Path) -> None:
        """Every documented TOML key is read into the configuration."""
        path = tmp_path / "kvroute.toml"
        path.write_text(FULL_TOML)
        config = load_toml(path)
        assert (config.host, config.port, config.max_body_bytes, config.max_attempts) == ("0.0.0.0", 9000, 1048576, 2)
        assert config.retry_after_s == 3 and config.forward_authorization is False and config.backend_header is None
        assert config.admin_token == "0123456789abcdef0123" and config.access_log is False
        assert config.passthrough_paths == ("/tokenize",)
        assert config.strategy == "bounded-load" and config.options == {"prefix_length": 2048, "load_factor": 1.5}
        assert (config.timeouts.connect, config.timeouts.first_byte, config.timeouts.idle) == (1.5, 30.0, 10.0)
        health = config.health
        assert (health.interval, health.timeout, health.unhealthy_threshold, health.healthy_threshold) == (2, 0.5, 4, 3)
        assert health.passive_ejection is False and health.discover_models is False
        a, b = config.backends
        assert a == BackendConfig(
            id="a", url="http://10.0.0.1:8000", models=("llama",), weight=2.0, labels={"zone": "z1"}, api_key="secret"
        )
        assert b.id == "10.0.0.2:8000" and b.adapter_options == {"health_path": "/ping"}

    @pytest.mark.parametrize(
        ("text", "message"),
        [
            ("[server]\nport = 'x'", "'port' must be int"),
            ("[server]\ncolour = 1", "unknown key(s) 'colour'"),
            ("[extra]\n", "unknown key(s) 'extra'"),
            ("[timeouts]\nidle = -1", "'idle' must be a number > 0"),
            ("[health]\nhealthy_threshold = 0", "'healthy_threshold' must be an integer >= 1"),
            ("[[backends]]\nurl = 'ftp://x'", "http:// or https://"),
            ("[[backends]]\nid='a'\nurl='http://x'\n[[backends]]\nid='a'\nurl='http://y'", "given twice"),
            ("[server]\nadmin_token = 'short'", "at least 16 characters"),
            ("[server]\nbackend_header = 'bad header'", "valid header name"),
            ("not toml =", "not valid TOML"),
        ],
    )
    def test_errors_name_the_key(self, tmp_path: Path, text: str, message: str) -> None:
        """A bad file raises ConfigError saying what was expected and what was got."""
        path = tmp_path / "bad.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_toml(path)

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing file is a ConfigError naming it."""
        with pytest.raises(ConfigError, match="does not exist"):
            load_toml(tmp_path / "nope.toml")


class TestFlags:
    @pytest.mark.parametrize(
        ("flag", "expected"),
        [
            ("http://h:1", BackendConfig(id="h:1", url="http://h:1")),
            ("b1=http://h:1/", BackendConfig(id="b1", url="http://h:1")),
            (
                "id=b2,url=http://h:2,weight=3,models=x;y,kind=openai",
                BackendConfig(id="b2", url="http://h:2", weight=3.0, models=("x", "y")),
            ),
            ("https://secure.example", BackendConfig(id="secure.example:443", url="https://secure.example")),
        ],
    )
    def test_backend_flag(self, flag: str, expected: BackendConfig) -> None:
        """--backend accepts a URL, ID=URL, or key=value pairs."""
        assert parse_backend_flag(flag) == expected

    @pytest.mark.parametrize("flag", ["", "id=x", "url=http://h,weight=abc", "url=http://h,oops"])
    def test_bad_backend_flag(self, flag: str) -> None:
        """A malformed --backend is a ConfigError."""
        with pytest.raises(ConfigError):
            parse_backend_flag(flag)

    def test_option_flags(self) -> None:
        """--option key=value pairs become strategy options with dashes turned to underscores."""
        assert parse_option_flags(["prefix-length=4096", "seed=1"]) == {"prefix_length": "4096", "seed": "1"}
        with pytest.raises(ConfigError, match="key=value"):
            parse_option_flags(["novalue"])

    def test_flags_override_file(self, tmp_path: Path) -> None:
        """Command-line flags win over the TOML file; backends from both are kept."""
        path = tmp_path / "kvroute.toml"
        path.write_text(FULL_TOML)
        config = build_config(
            config_file=str(path),
            backends=("c=http://h:3",),
            strategy="random",
            options=("seed=5",),
            port=7000,
            idle_timeout=5.0,
            health_interval=0.0,
            backend_header="x-chosen",
        )
        assert config.port == 7000 and config.strategy == "random" and config.options == {"seed": "5"}
        assert [b.id for b in config.backends] == ["a", "10.0.0.2:8000", "c"]
        assert config.timeouts.idle == 5.0 and config.timeouts.connect == 1.5
        assert config.health.interval == 0.0 and not config.health.enabled
        assert config.backend_header == "x-chosen"

    @pytest.mark.parametrize(
        ("toml", "flags", "expected"),
        [
            ("", {}, "home"),
            ('[slo]\nunmet = "sink"', {}, "sink"),
            ('[slo]\nunmet = "sink"', {"slo_unmet": "cheapest"}, "cheapest"),
        ],
    )
    def test_slo_unmet_reaches_the_choice(
        self, tmp_path: Path, toml: str, flags: dict[str, str], expected: str
    ) -> None:
        """``[slo] unmet`` / ``--slo-unmet`` is the policy of the SLO-aware choice the proxy builds (default home)."""
        path = tmp_path / "kvroute.toml"
        path.write_text("[slo]\naware = true\n" + toml.removeprefix("[slo]\n"))
        config = build_config(config_file=str(path), **flags)
        choice = slo_choice(config)
        assert config.slo.unmet == expected and choice is not None and choice.unmet_policy == expected

    def test_slo_unmet_unknown_policy(self, tmp_path: Path) -> None:
        """An unknown policy names the ones there are and what was given."""
        path = tmp_path / "kvroute.toml"
        path.write_text('[slo]\nunmet = "later"\n')
        with pytest.raises(ConfigError, match=r"'unmet' must be one of cheapest, home, sink \(got 'later'\)"):
            load_toml(path)
        result = CliRunner().invoke(serve, ["--slo-unmet", "later", "--check"])
        assert result.exit_code == 2 and "'later' is not one of 'cheapest', 'home', 'sink'" in result.output


SAGEMAKER = {
    "EndpointConfigName": "llm",
    "ProductionVariants": [
        {
            "VariantName": "AllTraffic",
            "ModelName": "llama",
            "InitialInstanceCount": 7,
            "RoutingConfig": {
                "RoutingStrategy": "PREFIX_AWARE",
                "PrefixAwareRoutingConfig": {"PrefixLength": 8000, "ConcurrencyThreshold": 16},
            },
        }
    ],
}


class TestSageMaker:
    def test_prefix_aware(self) -> None:
        """PREFIX_AWARE maps to bounded-load with prefix_length and concurrency_threshold."""
        assert import_sagemaker(SAGEMAKER) == ("bounded-load", {"prefix_length": 8000, "concurrency_threshold": 16})

    @pytest.mark.parametrize(
        ("name", "strategy"), [("RANDOM", "random"), ("LEAST_OUTSTANDING_REQUESTS", "least-outstanding")]
    )
    def test_other_strategies(self, name: str, strategy: str) -> None:
        """RANDOM and LEAST_OUTSTANDING_REQUESTS map to the plugins of the same meaning."""
        assert import_sagemaker({"RoutingConfig": {"RoutingStrategy": name}}) == (strategy, {})

    @pytest.mark.parametrize(
        ("doc", "variant", "message"),
        [
            ({"RoutingConfig": {"RoutingStrategy": "SMART"}}, None, "must be one of"),
            (
                {
                    "RoutingConfig": {
                        "RoutingStrategy": "PREFIX_AWARE",
                        "PrefixAwareRoutingConfig": {"PrefixLength": 10},
                    }
                },
                None,
                "between 1024 and 65536",
            ),
            (
                {
                    "RoutingConfig": {
                        "RoutingStrategy": "PREFIX_AWARE",
                        "PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 0},
                    }
                },
                None,
                "between 1 and 1024",
            ),
            (
                {"RoutingConfig": {"RoutingStrategy": "RANDOM", "PrefixAwareRoutingConfig": {"PrefixLength": 2048}}},
                None,
                "only valid with PREFIX_AWARE",
            ),
            ({"ProductionVariants": [{"VariantName": "a"}, {"VariantName": "b"}]}, None, "--sagemaker-variant"),
            (SAGEMAKER, "Other", "no production variant named 'Other'"),
            ({"ModelName": "x"}, None, "no 'RoutingConfig'"),
            ([1], None, "JSON object"),
        ],
    )
    def test_errors(self, doc: object, variant: str | None, message: str) -> None:
        """Invalid SageMaker documents raise ConfigError naming the field."""
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            import_sagemaker(doc, variant)

    def test_file_and_command(self, tmp_path: Path) -> None:
        """kvroute serve --sagemaker-config --check prints the imported strategy and options."""
        path = tmp_path / "endpoint-config.json"
        path.write_text(json.dumps(SAGEMAKER))
        assert load_sagemaker(path)[0] == "bounded-load"
        result = CliRunner().invoke(
            serve, ["--sagemaker-config", str(path), "--backend", "http://127.0.0.1:9", "--check"]
        )
        assert result.exit_code == 0, result.output
        printed = json.loads(result.stdout)
        assert printed["strategy"] == "bounded-load"
        assert printed["options"] == {"prefix_length": 8000, "concurrency_threshold": 16}


class TestServeCommand:
    def test_check_hides_secrets(self) -> None:
        """--check prints the effective configuration with the admin token and API keys hidden."""
        result = CliRunner().invoke(
            serve, ["--backend", "http://127.0.0.1:9", "--admin-token", "0123456789abcdef0", "--check"]
        )
        assert result.exit_code == 0, result.output
        printed = json.loads(result.stdout)
        assert printed["admin_token"] == "***" and "0123456789abcdef0" not in result.output
        assert printed["backends"][0]["url"] == "http://127.0.0.1:9"

    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (["--strategy", "no-such-strategy"], "unknown strategy 'no-such-strategy'"),
            (["--strategy", "least-outstanding", "--option", "bogus=1"], "has no option 'bogus'"),
            (["--backend", "ftp://x"], "http:// or https://"),
            (["--max-attempts", "0"], "'max_attempts' must be an integer >= 1"),
        ],
    )
    def test_bad_configuration_exits_with_message(self, args: list[str], message: str) -> None:
        """An invalid configuration stops the command with a one-line explanation."""
        result = CliRunner().invoke(serve, [*args, "--check"])
        assert result.exit_code != 0
        assert message in result.output

    def test_default_strategy_is_prefix_aware(self) -> None:
        """Without --strategy, kvroute serve routes with bounded-load and its default options."""
        assert ServerConfig().strategy == DEFAULT_STRATEGY == "bounded-load"
        result = CliRunner().invoke(serve, ["--backend", "http://127.0.0.1:9", "--check"])
        assert result.exit_code == 0, result.output
        printed = json.loads(result.stdout)
        assert (printed["strategy"], printed["options"]) == ("bounded-load", {})

    def test_missing_default_strategy_says_what_to_install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """With the server extra but not bounded-load, kvroute serve names the extra to install and the --strategy way
        out."""
        monkeypatch.setenv("KVROUTE_BLOCK_PLUGINS", "bounded-load")
        result = CliRunner().invoke(serve, ["--backend", "http://127.0.0.1:9", "--check"])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert result.stdout == ""
        assert result.stderr.startswith(
            "Error: the strategy 'bounded-load' (kvroute serve's default) is not installed. "
            'Install it with: pip install "kvroute[bounded-load]", '
            "or choose an installed strategy with --strategy NAME "
            "(installed: "
        )
        assert "least-outstanding" in result.stderr.partition("(installed: ")[2]

    def test_other_strategy_without_the_default(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without bounded-load installed, an explicitly chosen installed strategy still works."""
        monkeypatch.setenv("KVROUTE_BLOCK_PLUGINS", "bounded-load")
        result = CliRunner().invoke(
            serve, ["--backend", "http://127.0.0.1:9", "--strategy", "least-outstanding", "--check"]
        )
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["strategy"] == "least-outstanding"


def _doc_rows() -> list[tuple[set[str], list[str], list[str]]]:
    """docs/serve.md's settings table: per row, its flags, its TOML keys (``table.key``) and its defaults."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    table = text.split("| flag | TOML key | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in table.splitlines()[2:]:
        flag_cell, key_cell, default_cell = (cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:4])
        keys: list[str] = []
        for token in re.findall(r"`\[*([\w.-]+?)(?:\.NAME)?\]*`", key_cell):
            keys.append(keys[-1].rsplit(".", 1)[0] + token if token.startswith(".") else token)
        defaults = [part.strip() for part in re.split(r", | / ", default_cell)] if len(keys) > 1 else [default_cell]
        rows.append((set(re.findall(r"--[a-z-]+", flag_cell)), keys, defaults))
    return rows


def _doc_default(text: str) -> str:
    """A default as the table writes it, reduced to the value: '`gradual`' -> 'gradual', '30 s' -> '30'."""
    return re.sub(r" s$| \(.*\)$", "", text.replace("`", "").replace(",", "")).strip()


class TestSettingsDocs:
    @pytest.mark.parametrize(
        ("path", "meta"), [(p, m) for p, _, m in settings()], ids=[".".join(p) for p, _, _ in settings()]
    )
    def test_every_setting_has_a_row(self, path: tuple[str, ...], meta: Setting) -> None:
        """Each setting is a row of docs/serve.md's settings table with its flag, its TOML key and its default."""
        key = f"{toml_table(path, meta)}.{path[-1]}"
        rows = [(flags, keys, defaults) for flags, keys, defaults in _doc_rows() if key in keys]
        assert rows, f"{key} is not in docs/serve.md's settings table"
        flags, keys, defaults = rows[0]
        if meta.flag is not None:
            assert meta.flag in flags, f"{key}: the row does not name {meta.flag}"
        default: Any = ServerConfig()
        for name in path:
            default = getattr(default, name)
        if default is not None and not isinstance(default, tuple | dict):
            shown = _doc_default(defaults[keys.index(key)])
            if isinstance(default, bool):
                assert shown == ("on" if default else "off"), key
            elif isinstance(default, int | float):
                assert float(shown) == default, key
            else:
                assert shown == default, key

    def test_every_row_is_a_setting(self) -> None:
        """Every TOML key and flag the settings table names exists (besides the structured and command flags)."""
        known = {f"{toml_table(p, m)}.{p[-1]}" for p, _, m in settings()} | {"backends", "discovery", "peers.discovery"}
        flags = {m.flag for _, _, m in settings() if m.flag} | {
            f"--no-{m.flag[2:]}" for _, f, m in settings() if m.flag
        }
        structured = {"--config", "--backend", "--discovery", "--option", "--shadow", "--shadow-option", "--cache-view"}
        structured |= {"--peer", "--peer-discovery"}
        structured |= {"--sagemaker-config", "--sagemaker-variant", "--log-level", "--log-format"}
        for row_flags, keys, _ in _doc_rows():
            assert set(keys) <= known, keys
            assert row_flags <= flags | structured, row_flags


class TestSchema:
    def test_every_flag_is_an_option_with_the_fields_default(self) -> None:
        """Each setting with a flag is an option of kvroute serve whose help ends with the field's default."""
        options = {opt: param for param in serve.params for opt in param.opts}
        for path, _, meta in settings():
            if meta.flag is None:
                continue
            default: Any = ServerConfig()
            for name in path:
                default = getattr(default, name)
            help_text = options[meta.flag].help or ""
            assert help_text.startswith(meta.help), meta.flag
            if meta.show_default:
                shown = ("on" if default else "off") if isinstance(default, bool) else default
                shown = f"{shown:g}" if isinstance(shown, float) else shown
                assert help_text.endswith(f"[default: {shown}]."), meta.flag

    @pytest.mark.parametrize(
        ("args", "toml", "expected"),
        [([], "", "kvroute"), (["--http", "httptools"], "", "httptools"), ([], 'http = "httptools"', "httptools")],
    )
    def test_http(self, tmp_path: Path, args: list[str], toml: str, expected: str) -> None:
        """The http setting defaults to kvroute's protocol; --http and [server] http choose uvicorn's."""
        path = tmp_path / "c.toml"
        path.write_text(f"[server]\n{toml}\n")
        result = CliRunner().invoke(serve, ["--config", str(path), *args, "--check"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["http"] == expected

    def test_bad_http(self, tmp_path: Path) -> None:
        """An unknown protocol in the file is an error naming the choices."""
        path = tmp_path / "c.toml"
        path.write_text('[server]\nhttp = "h2"\n')
        with pytest.raises(ConfigError, match=r"^'http' must be one of kvroute, httptools \(got 'h2'\)\.$"):
            load_toml(path)

    def test_wrong_toml_type_names_table_and_key(self, tmp_path: Path) -> None:
        """A TOML value of the wrong type for its field is refused by the converter, naming the table and key."""
        path = tmp_path / "c.toml"
        path.write_text("[warm_join]\nprefill_timeout = true\n")
        with pytest.raises(ConfigError, match=r"^\[warm_join\] 'prefill_timeout' must be float \(got bool True\)\.$"):
            load_toml(path)
