//! The docs and the template stay true to the binaries: README.md names every `rowq` subcommand
//! and every `ROWQ_*` setting the code reads, and template.yaml alarms only on metrics the
//! scheduler or the worker prints, and graphs them all on a dashboard whose body is JSON.
//! Nothing here needs Postgres or SQS.

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn readme() -> String {
    std::fs::read_to_string(root().join("README.md")).expect("read README.md")
}

/// The subcommands `rowq ARGS --help` lists, without clap's own `help`.
fn subcommands(args: &[&str]) -> Vec<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_rowq")).args(args).arg("--help").output().expect("run rowq");
    assert!(output.status.success(), "rowq {args:?} --help failed");
    let text = String::from_utf8(output.stdout).expect("--help is UTF-8");
    let listed: Vec<String> = text
        .lines()
        .skip_while(|line| *line != "Commands:")
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect();
    assert!(!listed.is_empty(), "no commands found in rowq {args:?} --help:\n{text}");
    listed
}

#[test]
fn the_readme_names_every_subcommand_of_the_rowq_cli() {
    let readme = readme();
    let mut commands: Vec<String> = Vec::new();
    for command in subcommands(&[]) {
        let nested =
            Command::new(env!("CARGO_BIN_EXE_rowq")).args([command.as_str(), "--help"]).output().expect("run rowq");
        if String::from_utf8_lossy(&nested.stdout).lines().any(|line| line == "Commands:") {
            commands.extend(subcommands(&[&command]).into_iter().map(|sub| format!("{command} {sub}")));
        } else {
            commands.push(command);
        }
    }
    assert!(commands.iter().any(|c| c == "queues create"), "nested commands not read: {commands:?}");
    let missing: Vec<&String> = commands.iter().filter(|c| !readme.contains(&format!("`rowq {c}"))).collect();
    assert!(missing.is_empty(), "README.md does not name `rowq …` for {missing:?}");
}

fn rust_files(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("read a directory entry").path();
        if path.is_dir() {
            rust_files(&path, found);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            found.push(path);
        }
    }
}

/// Every `"ROWQ_…"` string literal in `src/`: the settings read with `Env` and clap's `env = …`.
fn settings_in_src() -> Vec<String> {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    let mut names: Vec<String> = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read a source file");
        for (at, _) in text.match_indices("\"ROWQ_") {
            let name: String = text[at + 1..]
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            if text[at + 1 + name.len()..].starts_with('"') {
                names.push(name);
            }
        }
    }
    names.sort();
    names.dedup();
    names
}

#[test]
fn the_readme_documents_every_setting_the_code_reads() {
    let settings = settings_in_src();
    assert!(settings.len() >= 20, "too few settings found, is the scan broken? {settings:?}");
    assert!(settings.iter().any(|s| s == "ROWQ_CLAIM_BATCH"), "{settings:?}");
    let readme = readme();
    let missing: Vec<&String> = settings.iter().filter(|s| !readme.contains(&format!("`{s}`"))).collect();
    assert!(missing.is_empty(), "README.md's configuration does not document {missing:?}");
}

/// Every metric the scheduler and the worker print.
fn printed_metrics() -> Vec<&'static str> {
    let all = rowq::metrics::GAUGES.iter().chain(&rowq::metrics::EXECUTIONS).chain(&rowq::metrics::MESSAGES);
    let all = all.chain(&rowq::metrics::DEAD_LETTERS).chain(&rowq::metrics::SENT_BACK);
    all.map(|(name, _)| *name).collect()
}

/// The template's alarms on rowq's own metrics read the namespace the scheduler, the worker and
/// the DLQ handler are given, one for all, and names they print: a typo in either would leave an alarm on a
/// metric that never exists (and, missing data breaching, always firing).
#[test]
fn the_templates_alarms_read_the_metrics_rowq_prints() {
    let template = std::fs::read_to_string(root().join("template.yaml")).expect("read template.yaml");
    let lines: Vec<&str> = template.lines().map(str::trim).collect();
    let namespaces: Vec<&str> = lines.iter().filter_map(|line| line.strip_prefix("ROWQ_METRICS_NAMESPACE: ")).collect();
    assert_eq!(namespaces.len(), 3, "the scheduler, the worker and the DLQ handler each set ROWQ_METRICS_NAMESPACE");
    assert!(
        namespaces.iter().all(|n| *n == namespaces[0]),
        "the functions report under several namespaces: {namespaces:?}"
    );
    let namespace = namespaces[0];
    let printed = printed_metrics();
    let mut alarmed = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        let Some(alarm_namespace) = line.strip_prefix("Namespace: ") else { continue };
        if alarm_namespace.starts_with("AWS/") {
            continue;
        }
        assert_eq!(alarm_namespace, namespace, "an alarm reads another namespace than the scheduler's");
        let metric = lines[at + 1].strip_prefix("MetricName: ").expect("MetricName after Namespace");
        assert!(printed.contains(&metric), "the template alarms on {metric}, which the scheduler does not print");
        alarmed.push(metric);
    }
    assert!(alarmed.contains(&"OldestClaimableSeconds"), "no alarm on the backlog's age: {alarmed:?}");
}

/// The dashboard's body is JSON once CloudFormation substitutes its `${…}` (nothing checks it
/// before a deploy otherwise), and its graphs of rowq's own metrics name metrics rowq prints.
#[test]
fn the_templates_dashboard_is_json_and_graphs_the_metrics_rowq_prints() {
    let template = std::fs::read_to_string(root().join("template.yaml")).expect("read template.yaml");
    let mut lines = template.lines().skip_while(|line| !line.trim_start().starts_with("DashboardBody: !Sub |"));
    let indent = |line: &str| line.len() - line.trim_start().len();
    let header = lines.next().expect("a DashboardBody in template.yaml");
    let body: Vec<&str> = lines.take_while(|line| line.trim().is_empty() || indent(line) > indent(header)).collect();
    // `${AWS::Region}`, `${RowqQueue}`, … each stand for a string.
    let mut text = body.join("\n");
    while let Some(start) = text.find("${") {
        let end = start + text[start..].find('}').expect("a closed ${…}");
        text.replace_range(start..=end, "x");
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("the dashboard is not JSON ({e}):\n{text}"));
    let printed = printed_metrics();
    let by_kind: Vec<&str> =
        rowq::metrics::EXECUTIONS.iter().chain(&rowq::metrics::DEAD_LETTERS).map(|(name, _)| *name).collect();
    let mut graphed = Vec::new();
    let mut searched = Vec::new();
    for widget in dashboard["widgets"].as_array().expect("widgets") {
        for metric in widget["properties"]["metrics"].as_array().expect("metrics") {
            if metric[0] == "rowq/x" {
                let name = metric[1].as_str().expect("a metric name");
                assert!(printed.contains(&name), "the dashboard graphs {name}, which rowq does not print");
                graphed.push(name);
            } else if let Some(expression) = metric[0]["expression"].as_str() {
                // SEARCH('{rowq/x,Queue,Kind} Queue="x" MetricName="NAME"', 'STAT', 60)
                let name = searched_metric(expression);
                assert!(by_kind.contains(&name), "the dashboard searches {name} by kind, which rowq does not print");
                searched.push(name);
                graphed.push(name);
            }
        }
    }
    assert!(searched.contains(&"JobsFailed"), "the dashboard shows no failures by kind");
    graphed.sort_unstable();
    graphed.dedup();
    let mut all = printed.clone();
    all.sort_unstable();
    assert_eq!(graphed, all, "the dashboard graphs every metric rowq prints");
}

/// The metric a dashboard's `SEARCH` of rowq's per-kind metrics names, checked to read them where
/// the worker puts them: rowq's namespace, the dimensions `Queue` and `Kind`, the stack's queue.
fn searched_metric(expression: &str) -> &str {
    let query = expression.strip_prefix("SEARCH('").and_then(|rest| rest.split('\'').next()).expect("SEARCH('…')");
    let (schema, terms) = query.split_once(' ').expect("a schema and search terms");
    assert_eq!(schema, "{rowq/x,Queue,Kind}", "{expression}");
    let terms: Vec<&str> = terms.split(' ').collect();
    assert_eq!(terms.len(), 2, "{expression}");
    assert_eq!(terms[0], "Queue=\"x\"", "{expression}");
    terms[1].strip_prefix("MetricName=\"").and_then(|name| name.strip_suffix('"')).expect("MetricName=\"…\"")
}
