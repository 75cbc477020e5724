//! The `rowq` command line (`rowq --help`); see `rowq::cli`.

fn main() {
    rowq::cli::main();
}
