//! Node-API's link settings for the platform (none are needed on Linux).

fn main() {
    napi_build::setup();
}
