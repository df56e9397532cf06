//! Unit tests of `config`: YAML and flag parsing, merging, validation and the errors it names.

use super::parse::{locate, Node};
use super::*;
use tandem_engine::EngineConfig;

#[test]
fn byte_sizes_parse_units() {
    assert_eq!("1GiB".parse::<ByteSize>().unwrap().0, 1 << 30);
    assert_eq!("512MiB".parse::<ByteSize>().unwrap().0, 512 << 20);
    assert_eq!("2GB".parse::<ByteSize>().unwrap().0, 2_000_000_000);
    assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
    assert_eq!("1.5 KiB".parse::<ByteSize>().unwrap().0, 1536);
    assert!("lots".parse::<ByteSize>().is_err());
    assert!("1XB".parse::<ByteSize>().is_err());
    assert!("0".parse::<ByteSize>().is_err());
}

/// Shown sizes (clap's defaults) use the largest exact binary unit and parse back to the same count.
#[test]
fn byte_sizes_display_in_exact_units_and_read_back() {
    for (bytes, shown) in [
        (1usize << 30, "1GiB"),
        (1536 << 20, "1536MiB"),
        (3 << 40, "3TiB"),
        (1536, "1536"),
        (3072, "3KiB"),
        (4097, "4097"),
        (2_000_000_000, "1953125KiB"),
    ] {
        assert_eq!(ByteSize(bytes).to_string(), shown);
        assert_eq!(shown.parse::<ByteSize>().unwrap().0, bytes);
    }
}

#[test]
fn full_document_parses_and_flags_override() {
    let file = Settings::from_yaml(
        "model: m.gguf\nserved_model_name: smol\nserver: {host: 0.0.0.0, port: 9000, api_key: k}\n\
         engine: {block_size: 32, kv_cache_memory: 256MiB, max_num_seqs: 8, enable_prefix_caching: false}\n\
         deployment: {mode: colocated}\n",
    )
    .unwrap();
    let args = Settings {
        server: ServerSettings {
            port: Some(9100),
            ..ServerSettings::default()
        },
        engine: EngineSettings {
            max_num_seqs: Some(4),
            ..EngineSettings::default()
        },
        ..Settings::default()
    };
    let s = Settings::colocated(&args, file).unwrap();
    assert_eq!(s.model, Some(PathBuf::from("m.gguf")));
    assert_eq!(s.served_model_name.as_deref(), Some("smol"));
    assert_eq!(s.host(), "0.0.0.0");
    assert_eq!(s.port(), 9100);
    assert_eq!(s.server.api_key.as_deref(), Some("k"));
    let engine = s.engine.engine_config();
    assert_eq!(engine.block_size, 32);
    assert_eq!(engine.kv_cache_memory, 256 << 20);
    assert_eq!(engine.max_num_seqs, 4);
    assert!(!engine.enable_prefix_caching);
}

#[test]
fn defaults_without_file() {
    let s = Settings::colocated(&Settings::default(), Settings::default()).unwrap();
    assert_eq!(s.host(), "127.0.0.1");
    assert_eq!(s.port(), 8000);
    assert_eq!(s.model, None);
    let d = EngineConfig::default();
    assert_eq!(s.engine.engine_config().block_size, d.block_size);
    let args = Settings {
        engine: EngineSettings {
            enable_chunked_prefill: Some(false),
            ..EngineSettings::default()
        },
        ..Settings::default()
    };
    assert!(
        !Settings::colocated(&args, Settings::default())
            .unwrap()
            .engine
            .engine_config()
            .enable_chunked_prefill
    );
}

#[test]
fn device_comes_from_the_file_and_the_flag_wins() {
    let file = Settings::from_yaml("engine: {device: cuda}\n").unwrap();
    let s = Settings::colocated(&Settings::default(), file.clone()).unwrap();
    assert_eq!(s.device(), Device::Cuda);
    let args = Settings {
        engine: EngineSettings {
            device: Some(Device::Cpu),
            ..EngineSettings::default()
        },
        ..Settings::default()
    };
    assert_eq!(
        Settings::colocated(&args, file).unwrap().device(),
        Device::Cpu
    );
    let default = Settings::colocated(&Settings::default(), Settings::default()).unwrap();
    assert_eq!(default.device(), Device::Cpu);
    assert!(Settings::from_yaml("engine: {device: tpu}\n").is_err());
}

#[test]
fn unknown_keys_are_named() {
    let err = Settings::from_yaml("server: {hots: x}\n").unwrap_err();
    assert!(format!("{err:#}").contains("hots"), "{err:#}");
    let err = Settings::from_yaml("engine: {blok_size: 3}\n").unwrap_err();
    assert!(format!("{err:#}").contains("blok_size"), "{err:#}");
    let err = Settings::from_yaml("modle: x\n").unwrap_err();
    assert!(format!("{err:#}").contains("modle"), "{err:#}");
}

#[test]
fn every_problem_is_reported_at_once_by_its_path_with_suggestions() {
    let err = Settings::from_yaml(
        "modle: x\nengine: {blok_size: 3, max_num_seqs: lots, threads: 2}\nfrobnicate: 1\n\
         deployment: {mode: pd, kv_transfer: {transprt: tcp}, routing: {prefill_load_bound: -1}}\n",
    )
    .unwrap_err();
    let text = format!("{err:#}");
    for want in [
        "6 problems in the settings",
        "modle: unknown key, did you mean `model`?",
        "engine.blok_size: unknown key, did you mean `block_size`?",
        "engine.max_num_seqs: invalid type: string \"lots\"",
        "deployment.kv_transfer.transprt: unknown key, did you mean `transport`?",
        "deployment.routing.prefill_load_bound: invalid value",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
    assert!(
        text.contains("frobnicate: unknown key\n") || text.ends_with("frobnicate: unknown key"),
        "no suggestion when nothing is close:\n{text}"
    );
    let one = Settings::from_yaml("engine: {block_size: 0x}\n").unwrap_err();
    assert!(
        format!("{one:#}")
            .starts_with("1 problem in the settings:\n  line 1, column 22: engine.block_size: "),
        "{one:#}"
    );
    assert!(
        Settings::from_yaml("").is_ok(),
        "empty YAML is all defaults"
    );
    // A config file named on purpose that holds nothing (`--config /dev/null`) is refused.
    let empty = std::env::temp_dir().join(format!("tandem-empty-{}.yaml", std::process::id()));
    std::fs::write(&empty, "# only a comment\n").unwrap();
    let err = Settings::load(&empty).map_err(|e| format!("{e:#}"));
    std::fs::remove_file(&empty).unwrap();
    assert!(err.unwrap_err().contains("holds no settings"));
    // `server:` has a flattened part, whose unknown-key message lists no keys: the defaults do.
    let flat = Settings::from_yaml("server: {prot: 1, max_conections: 3}\n").unwrap_err();
    for want in [
        "server.prot: unknown key, did you mean `port`?",
        "server.max_conections: unknown key, did you mean `max_connections`?",
    ] {
        assert!(
            format!("{flat:#}").contains(want),
            "{want:?} not in {flat:#}"
        );
    }
    let syntax = Settings::from_yaml("engine: {block_size: 3\n").unwrap_err();
    assert!(format!("{syntax:#}").contains("line"), "{syntax:#}");
}

#[test]
fn every_problem_names_its_line_and_column() {
    let text = "# a tandem config\n\
                model: models/x.gguf\n\
                engine:\n  \
                  block_size: 16\n  \
                  blok_size: 3\n  \
                  max_num_seqs: lots\n\
                server: {port: 8000, prot: 1}\n\
                deployment:\n  \
                  mode: pd\n  \
                  prefill:\n    \
                    engine: {threads: many}\n\
                modle: y\n";
    let err = format!("{:#}", Settings::from_yaml(text).unwrap_err());
    for want in [
        "line 5, column 3: engine.blok_size: unknown key, did you mean `block_size`?",
        "line 6, column 17: engine.max_num_seqs: invalid type: string \"lots\"",
        "line 7, column 22: server.prot: unknown key, did you mean `port`?",
        "line 11, column 23: deployment.prefill.engine.threads: invalid type",
        "line 12, column 1: modle: unknown key, did you mean `model`?",
    ] {
        assert!(err.contains(want), "{want:?} not in:\n{err}");
    }
    assert_eq!(
        locate(text, &["engine".into(), "block_size".into()], Node::Key),
        Some((4, 3))
    );
    assert_eq!(
        locate(text, &["engine".into(), "absent".into()], Node::Key),
        None
    );
    assert_eq!(
        locate(
            "a: [x, {b: 1}]\n",
            &["a".into(), "1".into(), "b".into()],
            Node::Value
        ),
        Some((1, 12))
    );
}

#[test]
fn pd_sections_parse_typed_and_stay_out_of_colocated() {
    let file = Settings::from_yaml(
        "deployment:\n  mode: pd\n  prefill: {replicas: 1}\n  decode: {replicas: 2, engine: {block_size: 16}}\n  \
         kv_transfer: {transport: shm, streams: 2}\n  routing: {local_prefill_threshold: 64}\n  \
         timeouts: {prefill_secs: 5}\n",
    )
    .unwrap();
    let d = file.deployment.clone().unwrap();
    assert_eq!(d.mode, DeploymentMode::Pd);
    assert_eq!(d.decode.unwrap().replicas, Some(2));
    let kv = d.kv_transfer.unwrap();
    assert_eq!(
        (kv.transport, kv.streams),
        (tandem_cluster::TransportKind::Shm, 2)
    );
    assert_eq!(d.routing.unwrap().local_prefill_threshold, 64);
    assert_eq!(d.timeouts.unwrap().prefill_secs, 5.0);
    let err = Settings::colocated(&Settings::default(), file).unwrap_err();
    assert!(err.to_string().contains("P/D launcher"), "{err}");
    let err =
        Settings::from_yaml("deployment: {mode: pd, kv_transfer: {transprot: tcp}}\n").unwrap_err();
    assert!(format!("{err:#}").contains("transprot"), "{err:#}");
    let colocated =
        Settings::from_yaml("deployment: {routing: {prefill_load_bound: 1}}\n").unwrap();
    assert!(Settings::colocated(&Settings::default(), colocated).is_err());
    assert!(Settings::from_yaml("deployment: {mode: sideways}\n").is_err());
}

#[test]
fn discovery_parses_is_checked_naming_the_key_and_resolves() {
    let file = Settings::from_yaml(
        "deployment:\n  mode: pd\n  prefill: {replicas: 0}\n  decode: {replicas: 0}\n  discovery:\n    \
         mode: dns\n    prefill: \"prefill:8100\"\n    decode: \"decode:8100\"\n    interval_secs: 3\n",
    )
    .unwrap();
    let s = resolved(&Settings::default(), file).unwrap();
    let d = s.deployment.as_ref().unwrap();
    let discovery = d.discovery.clone().unwrap();
    assert_eq!(discovery.mode, tandem_cluster::DiscoveryMode::Dns);
    assert_eq!(discovery.decode.as_deref(), Some("decode:8100"));
    assert_eq!(discovery.interval_secs, 3.0);
    assert_eq!(d.decode.as_ref().unwrap().replicas, Some(0));
    assert_eq!(
        d.timeouts.as_ref().unwrap().poll_interval_secs,
        0.5,
        "defaults filled"
    );
    // What --check-config prints reads back to the same settings.
    let printed = serde_yaml::to_string(&s).unwrap();
    let again = resolved(&Settings::default(), Settings::from_yaml(&printed).unwrap()).unwrap();
    assert_eq!(serde_yaml::to_string(&again).unwrap(), printed);

    for (yaml, key) in [
        (
            "discovery: {mode: dns, decode: decode}",
            "deployment.discovery.decode",
        ),
        ("discovery: {mode: dns}", "deployment.discovery.decode"),
        (
            "discovery: {mode: static, prefill: \"p:1\"}",
            "deployment.discovery.prefill",
        ),
        (
            "discovery: {mode: dns, decode: \"d:1\", interval_secs: -1}",
            "deployment.discovery.interval_secs",
        ),
    ] {
        let file = Settings::from_yaml(&format!("deployment: {{mode: pd, {yaml}}}\n")).unwrap();
        let err = resolved(&Settings::default(), file).unwrap_err();
        assert!(format!("{err:#}").contains(key), "{yaml}: {err:#}");
    }
    let err =
        Settings::from_yaml("deployment: {mode: pd, discovery: {mode: dns, intervl_secs: 1}}\n")
            .unwrap_err();
    assert!(format!("{err:#}").contains("intervl_secs"), "{err:#}");
    let err = Settings::from_yaml("deployment: {mode: pd, discovery: {mode: mdns}}\n").unwrap_err();
    assert!(format!("{err:#}").contains("mdns"), "{err:#}");
    let colocated = Settings::from_yaml("deployment: {discovery: {mode: dns}}\n").unwrap();
    assert!(Settings::colocated(&Settings::default(), colocated).is_err());
    let keyed = Settings::from_yaml("server: {api_key: secret}\n").unwrap();
    let s = resolved(&Settings::default(), keyed).unwrap();
    assert!(!serde_yaml::to_string(&s).unwrap().contains("secret"));
    let closed = Settings::from_yaml("server: {probes_need_key: true}\n").unwrap();
    let err = resolved(&Settings::default(), closed).unwrap_err();
    assert!(format!("{err:#}").contains("server.api_key"), "{err:#}");
    let closed = Settings::from_yaml("server: {probes_need_key: true, api_key: k}\n").unwrap();
    assert!(resolved(&Settings::default(), closed).is_ok());
    for yaml in [
        "deployment: {mode: pd, cluster_token: s3cret-token}\n",
        "deployment: {mode: colocated, cluster_token: s3cret-token}\n",
    ] {
        let s = resolved(&Settings::default(), Settings::from_yaml(yaml).unwrap()).unwrap();
        let printed = serde_yaml::to_string(&s).unwrap();
        assert!(!printed.contains("s3cret"), "{printed}");
        assert!(printed.contains("cluster_token: (set)"), "{printed}");
    }
    let both = Settings::from_yaml(
        "deployment: {mode: pd, cluster_token: a, cluster_token_file: /run/secrets/t}\n",
    )
    .unwrap();
    let err = resolved(&Settings::default(), both).unwrap_err();
    assert!(format!("{err:#}").contains("cluster_token_file"), "{err:#}");
}

#[test]
fn a_value_a_check_refuses_names_its_line_in_the_file() {
    let dir = std::env::temp_dir().join(format!("tandem-config-lines-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "server:\n  port: 9000\n  max_connections: 0\n",
            "line 3, column 20: server.max_connections must be at least 1",
        ),
        (
            "deployment:\n  mode: pd\n  decode:\n    replicas: 1\n    mps_thread_percentage: 250\n",
            "line 5, column 28: deployment.decode.mps_thread_percentage is 250",
        ),
        (
            "deployment:\n  mode: pd\n  discovery: {mode: dns, decode: \"d:1\", interval_secs: -1}\n",
            "line 3, column 56: deployment.discovery.interval_secs is wrong",
        ),
    ];
    for (i, (yaml, want)) in cases.into_iter().enumerate() {
        let path = dir.join(format!("c{i}.yaml"));
        std::fs::write(&path, yaml).unwrap();
        let err = format!("{:#}", Settings::load(&path).unwrap_err());
        assert!(err.contains(want), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_mps_share_outside_1_to_100_is_refused_naming_its_key() {
    for (p, ok) in [(0, false), (1, true), (100, true), (101, false)] {
        let yaml = format!("deployment: {{mode: pd, prefill: {{mps_thread_percentage: {p}}}}}\n");
        let r = resolved(&Settings::default(), Settings::from_yaml(&yaml).unwrap());
        match r {
            Ok(_) => assert!(ok, "{p} accepted"),
            Err(e) => {
                assert!(!ok, "{p}: {e:#}");
                let msg = format!("{e:#}");
                assert!(
                    msg.contains("deployment.prefill.mps_thread_percentage"),
                    "{msg}"
                );
            }
        }
    }
}

#[test]
fn cuda_devices_name_one_gpu_per_replica() {
    for (yaml, ok) in [
        ("{replicas: 2, cuda_devices: [1, 2]}", true),
        ("{cuda_devices: [1]}", true),
        ("{cuda_devices: [0, 1]}", false),
        ("{replicas: 3, cuda_devices: [1, 2]}", false),
        ("{replicas: 0, cuda_devices: [1]}", false),
    ] {
        let doc = format!("deployment: {{mode: pd, decode: {yaml}}}\n");
        let r = resolved(&Settings::default(), Settings::from_yaml(&doc).unwrap());
        match r {
            Ok(_) => assert!(ok, "{yaml} accepted"),
            Err(e) => {
                let msg = format!("{e:#}");
                assert!(!ok, "{yaml}: {msg}");
                assert!(msg.contains("deployment.decode.cuda_devices"), "{msg}");
                assert!(msg.contains("one ordinal per replica"), "{msg}");
            }
        }
    }
}

#[test]
fn listener_limits_are_server_keys_and_flags_checked_and_resolved() {
    let file = Settings::from_yaml(
        "server: {port: 9000, header_read_timeout_secs: 2, max_connections: 64}\n",
    )
    .unwrap();
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let flags = <Cli as clap::Parser>::try_parse_from(["serve", "--body-read-timeout-secs", "5"])
        .unwrap()
        .serve
        .settings;
    let s = Settings::colocated(&flags, file).unwrap();
    let limits = s.server.listen.limits();
    assert_eq!(
        limits.header_read_timeout,
        std::time::Duration::from_secs(2)
    );
    assert_eq!(limits.body_read_timeout, std::time::Duration::from_secs(5));
    assert_eq!((limits.max_connections, s.port()), (64, 9000));
    let defaults = ListenSettings::default().limits();
    assert_eq!(defaults, tandem_api::ServeLimits::default());
    assert_eq!(defaults.header_read_timeout.as_secs(), 10);
    assert_eq!(defaults.body_read_timeout.as_secs(), 30);
    assert_eq!(defaults.max_connections, 1024);

    let err = Settings::from_yaml("server: {header_read_timeout: 2}\n").unwrap_err();
    assert!(
        format!("{err:#}").contains("header_read_timeout"),
        "{err:#}"
    );
    for (yaml, key) in [
        ("header_read_timeout_secs: 0", "header_read_timeout_secs"),
        ("body_read_timeout_secs: -1", "body_read_timeout_secs"),
        ("max_connections: 0", "max_connections"),
    ] {
        let file = Settings::from_yaml(&format!("server: {{{yaml}}}\n")).unwrap();
        let err = Settings::colocated(&Settings::default(), file.clone()).unwrap_err();
        assert!(format!("{err:#}").contains(key), "{yaml}: {err:#}");
        assert!(resolved(&Settings::default(), file).is_err());
    }
    let printed = resolved(&Settings::default(), Settings::default()).unwrap();
    let text = serde_yaml::to_string(&printed).unwrap();
    for key in [
        "header_read_timeout_secs: 10",
        "body_read_timeout_secs: 30",
        "max_connections: 1024",
    ] {
        assert!(text.contains(key), "{key} missing from:\n{text}");
    }
}

#[test]
fn every_shipped_example_parses() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".yaml") || n.ends_with(".yml"))
        .collect();
    names.sort();
    for name in [
        "pd.yaml",
        "pd-2p1d.yaml",
        "colocated.yaml",
        "pd-parallel.yaml",
        "pd-dns.yaml",
    ] {
        assert!(names.iter().any(|n| n == name), "{name} missing: {names:?}");
    }
    for name in &names {
        let file = Settings::load(&dir.join(name)).unwrap();
        resolved(&Settings::default(), file.clone()).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let mode = file.deployment.as_ref().map(|d| d.mode).unwrap_or_default();
        assert_eq!(mode == DeploymentMode::Pd, name.starts_with("pd"), "{name}");
    }
}

#[test]
fn flags_fill_the_same_fields_as_the_file_and_win() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let cli = <Cli as clap::Parser>::try_parse_from([
        "serve",
        "m.gguf",
        "--port",
        "9000",
        "--no-chunked-prefill",
        "--pipeline-stages",
        "a:1,b:2",
        "--kv-cache-memory",
        "1GiB",
    ])
    .unwrap()
    .serve
    .settings;
    let file = Settings::from_yaml(
        "model: other.gguf\nserver: {port: 1, host: h}\n\
         engine: {enable_chunked_prefill: true, enable_prefix_caching: false, threads: 3}\n",
    )
    .unwrap();
    let s = Settings::colocated(&cli, file).unwrap();
    assert_eq!(s.model, Some(PathBuf::from("m.gguf")));
    assert_eq!((s.host(), s.port()), ("h".to_owned(), 9000));
    let e = s.engine.engine_config();
    assert!(!e.enable_chunked_prefill && !e.enable_prefix_caching);
    assert_eq!((e.threads, e.kv_cache_memory), (3, 1 << 30));
    assert_eq!(e.pipeline_stages, ["a:1", "b:2"]);
    // An absent flag leaves the file's value: `--no-prefix-caching` is no `enable_prefix_caching: true`.
    assert_eq!(cli.engine.enable_prefix_caching, None);
}

/// Every key of `engine:` but `device` is an `EngineConfig` field of the same name, so the serde mapping
/// of `engine_config` drops none, and a launcher's `EngineSettings::of` gives a child the same engine.
#[test]
fn every_engine_key_reaches_the_engine() {
    let set: EngineSettings = serde_yaml::from_str(
        "{block_size: 32, kv_cache_memory: 48MiB, max_num_seqs: 3, max_num_batched_tokens: 100, \
         enable_chunked_prefill: false, enable_prefix_caching: false, max_model_len: 99, max_waiting: 7, \
         threads: 5, tensor_parallel_size: 2, expert_placement: round_robin, llamacpp_orders: true, \
         pipeline_parallel_size: 4, pipeline_micro_batches: 6, pipeline_stages: ['a:1'], device: cpu}",
    )
    .unwrap();
    let keys = serde_json::to_value(&set).unwrap();
    let keys = keys.as_object().unwrap();
    assert!(
        keys.values().all(|v| !v.is_null()),
        "every key set: {keys:?}"
    );
    let engine = set.engine_config();
    let fields = serde_json::to_value(&engine).unwrap();
    for (key, value) in keys.iter().filter(|(k, _)| *k != "device") {
        assert_eq!(fields.get(key), Some(value), "engine.{key}");
    }
    assert_eq!(engine.kv_cache_memory, 48 << 20);
    assert_eq!(
        engine.expert_placement,
        tandem_model::ExpertPlacement::RoundRobin
    );
    assert!(engine.llamacpp_orders);
    let back = EngineSettings::of(&engine, Device::Cpu);
    assert_eq!(
        serde_json::to_value(&back).unwrap(),
        serde_json::to_value(&set).unwrap()
    );
    let defaults = EngineSettings::default().engine_config();
    assert_eq!(
        serde_json::to_value(&defaults).unwrap(),
        serde_json::to_value(EngineConfig::default()).unwrap()
    );
}

#[test]
fn reasoning_parser_is_a_key_and_a_flag_and_auto_reads_the_template() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let file = Settings::from_yaml("reasoning_parser: off\n").unwrap();
    assert_eq!(file.reasoning_parser, Some(ReasoningParserMode::Off));
    let none = Settings::colocated(&Settings::default(), file.clone()).unwrap();
    assert_eq!(none.reasoning_parser, Some(ReasoningParserMode::Off));
    let flags = <Cli as clap::Parser>::try_parse_from(["serve", "--reasoning-parser", "on"])
        .unwrap()
        .serve
        .settings;
    let s = Settings::colocated(&flags, file).unwrap();
    assert_eq!(s.reasoning_parser, Some(ReasoningParserMode::On));
    let err = Settings::from_yaml("reasoning_parser: maybe\n").unwrap_err();
    assert!(format!("{err:#}").contains("reasoning_parser"), "{err:#}");

    let qwen3 = "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}";
    let plain = "{{ '<|im_start|>assistant\\n' }}";
    let auto = ReasoningParserMode::default();
    assert_eq!(auto, ReasoningParserMode::Auto);
    assert!(auto.enabled(Some(qwen3)));
    assert!(!auto.enabled(Some(plain)) && !auto.enabled(None));
    assert!(ReasoningParserMode::On.enabled(Some(plain)));
    assert!(!ReasoningParserMode::Off.enabled(Some(qwen3)));
}

#[test]
fn kv_offload_is_a_nested_key_and_three_flags_checked_naming_the_field() {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let off = Settings::colocated(&Settings::default(), Settings::default()).unwrap();
    let e = off.engine.engine_config();
    assert!(!e.kv_offload.enabled(), "off by default");

    let file = Settings::from_yaml(
        "engine: {kv_offload: {host: 64GiB, disk: {path: /var/kv, size: 500GiB}}}\n",
    )
    .unwrap();
    let e = Settings::colocated(&Settings::default(), file.clone())
        .unwrap()
        .engine
        .engine_config();
    assert_eq!(e.kv_offload.host, Some(64 << 30));
    let disk = e.kv_offload.disk.clone().unwrap();
    assert_eq!(
        (disk.path, disk.size),
        (PathBuf::from("/var/kv"), 500 << 30)
    );
    // A launcher hands the same tiers to a process it starts.
    let back = EngineSettings::of(&e, Device::Cpu).engine_config();
    assert_eq!(back.kv_offload, e.kv_offload);

    let cli = <Cli as clap::Parser>::try_parse_from([
        "serve",
        "--host",
        "0.0.0.0",
        "--kv-offload-host",
        "1GiB",
        "--kv-offload-disk-size",
        "2GiB",
    ])
    .unwrap()
    .serve
    .settings;
    let e = Settings::colocated(&cli, file)
        .unwrap()
        .engine
        .engine_config();
    assert_eq!(e.kv_offload.host, Some(1 << 30));
    assert_eq!(cli.host(), "0.0.0.0", "distinct from the server's --host");
    let disk = e.kv_offload.disk.unwrap();
    assert_eq!((disk.path, disk.size), (PathBuf::from("/var/kv"), 2 << 30));

    let cli = <Cli as clap::Parser>::try_parse_from(["serve", "--kv-offload-disk", "/tmp/kv"])
        .unwrap()
        .serve
        .settings;
    let err = format!(
        "{:#}",
        Settings::colocated(&cli, Settings::default()).unwrap_err()
    );
    assert!(err.contains("engine.kv_offload.disk.size"), "{err}");

    let err = format!(
        "{:#}",
        Settings::from_yaml("engine: {kv_offload: {host: lots}}\n").unwrap_err()
    );
    assert!(err.contains("kv_offload"), "{err}");
    let err = format!(
        "{:#}",
        Settings::from_yaml("engine: {kv_offload: {disk: {path: /x, size: 1GiB, speed: 9}}}\n")
            .unwrap_err()
    );
    assert!(err.contains("speed"), "{err}");

    let dir = std::env::temp_dir().join(format!("tandem-config-kv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.yaml");
    std::fs::write(&path, "engine:\n  kv_offload:\n    disk: {size: 1GiB}\n").unwrap();
    let err = format!("{:#}", Settings::load(&path).unwrap_err());
    assert!(err.contains("engine.kv_offload.disk.path"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn engine_flag_ids_are_every_engine_flag() {
    let cmd = <EngineSettings as clap::Args>::augment_args(clap::Command::new("t"));
    let mut ids: Vec<String> = cmd
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect();
    ids.sort();
    let mut listed: Vec<String> = ENGINE_FLAG_IDS.iter().map(|s| s.to_string()).collect();
    listed.sort();
    assert_eq!(ids, listed);
}
