//! The `rowq` command line.

fn main() {
    println!("rowq");
}
