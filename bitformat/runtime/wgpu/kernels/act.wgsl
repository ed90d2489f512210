// act.wgsl: the FFN gate's activation, relu(g)^2 (ACT 0, BitNet 2B-4T) or silu (ACT 1); the
// including kernel declares the override ACT. Pasted once however many files include it.

fn act(g: f32) -> f32 {
    if (ACT == 0u) {
        let r = max(g, 0.0);
        return r * r;
    }
    return g / (1.0 + exp(-g));
}
