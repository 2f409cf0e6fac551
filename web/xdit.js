// comfyui-xdit: the text the xDiT nodes return as their UI output (ComfyUI's PreviewText: the backend's status, the
// layout a sampler ran), shown on the node itself once it has run, in a read-only box under its widgets.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const NODES = new Set(["XDiTBackend", "XDiTSampler", "XDiTSamplerAdvanced"]);
const WIDGET = "xdit_status";

app.registerExtension({
  name: "comfyui-xdit.node-text",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      const text = (message?.text ?? []).join("\n");
      let widget = this.widgets?.find((w) => w.name === WIDGET);
      if (!widget) {
        widget = ComfyWidgets.STRING(this, WIDGET, ["STRING", { multiline: true }], app).widget;
        widget.inputEl.readOnly = true;
        widget.inputEl.style.opacity = 0.75;
        widget.serialize = false; // the node's saved widget values stay its own
      }
      widget.value = text;
      this.setSize([Math.max(this.size[0], 320), Math.max(this.size[1], this.computeSize()[1])]);
      app.graph.setDirtyCanvas(true, false);
    };
  },
});
