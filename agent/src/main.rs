//! The `plugin-agent` binary.

fn main() {
    println!("plugin-agent");
}
